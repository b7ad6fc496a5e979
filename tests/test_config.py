"""Config: typos and bad values fail loudly before anything runs."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from jax_dora.config import ConfigError, base_config, validate

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_train(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, "-m", "jax_dora.train", "--config=configs/tiny.py",
       "--config.precompile=False", *args],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
  )


def test_unknown_config_key_fails_with_clear_message():
  proc = _run_train("--config.learner.learning_rat=0.1")
  assert proc.returncode != 0
  assert "learning_rat" in proc.stderr
  assert "Traceback" not in proc.stderr.splitlines()[-1]


def test_bad_value_is_rejected_by_validation():
  proc = _run_train("--config.mode=fastest")
  assert proc.returncode == 2
  assert "config.mode='fastest'" in proc.stderr


def test_validate_catches_inconsistent_lengths():
  c = base_config()
  c.rollout.max_new_tokens = 1000
  with pytest.raises(ConfigError, match="max_seq_len"):
    validate(c)
  validate(base_config())


def test_main_job_cli_runs_with_relative_output_dir(tmp_path):
  """The README's main command, shortened: relative paths, embedded servers."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "jax_dora.train", f"--config={ROOT}/configs/tiny.py",
       "--config.precompile=False",
       "--config.total_steps=2", "--config.output_dir=runs/cli", "--config.eval.num_prompts=8"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = (tmp_path / "runs" / "cli" / "summary.json").read_text()
  assert '"steps": 2' in summary and '"integrity_violations": []' in summary
  assert "step 2 | reward" in proc.stderr  # config.log_every: the last step is always logged


def test_real_model_settings_are_validated():
  c = base_config()
  c.data.prompt_template = "chat"
  with pytest.raises(ConfigError, match="chat needs model.hf_path"):
    validate(c)
  c = base_config()
  c.data.train_files = "train.jsonl"
  with pytest.raises(ConfigError, match="'task', which scores the synthetic tasks"):
    validate(c)
  c.reward.functions = "math_verify,bogus"
  with pytest.raises(ConfigError, match=r"unknown \['bogus'\]"):
    validate(c)
  c.reward.functions = "math_verify"
  c.learner.micro_batch_size = 5
  with pytest.raises(ConfigError, match="micro_batch_size=5 does not divide"):
    validate(c)
  c.learner.micro_batch_size = 0
  c.learner.group_micro_batches_by_length = True
  with pytest.raises(ConfigError, match="group_micro_batches_by_length needs"):
    validate(c)


def test_hf_path_on_the_tiny_config_is_a_clear_input_error(hf_dirs):
  """The tiny config's architecture values disagree with the checkpoint: exit 2, with
  the file, the field and what to do, not a traceback or a silent reshape."""
  proc = _run_train(f"--config.model.hf_path={hf_dirs['qwen2']}", "--config.output_dir=/tmp/x")
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("input error: model.")
  assert "config.json gives" in last and "hf_model_config" in last


def test_training_temperature_must_be_positive():
  """Temperature 0 used to pass and the learner divided logits by it: NaN params."""
  for t in (0.0, -1.0):
    c = base_config()
    c.rollout.temperature = t
    with pytest.raises(ConfigError, match="temperature=.* must be > 0"):
      validate(c)
  proc = _run_train("--config.rollout.temperature=0", "--config.output_dir=/tmp/x")
  assert proc.returncode == 2 and "config error: config.rollout.temperature" in proc.stderr


def test_role_is_read_and_checked():
  c = base_config()
  c.role = "learner"  # without server addresses it used to start embedded servers
  with pytest.raises(ConfigError, match="role=learner needs config.rollout.server_addresses"):
    validate(c)
  c = base_config()
  c.rollout.server_addresses = "localhost:9000"
  with pytest.raises(ConfigError, match="set config.role=learner"):
    validate(c)
  c.role = "learner"
  validate(c)
  proc = _run_train("--config.role=rollout", "--config.output_dir=/tmp/x")
  assert proc.returncode == 2 and "jax_dora.rollout.server_main" in proc.stderr


def test_dead_fields_are_gone():
  c = base_config()
  assert "partial_rollout_fraction" not in c.orchestrator


@pytest.mark.parametrize("key, value, match", [
    ("loss", "ppo2", r"learner.loss='ppo2' is not one of \['cispo', 'decoupled_ppo', 'grpo', 'gspo', 'sft'\]"),
    ("is_correction", "clip", "is_correction='clip'"),
    ("loss_aggregation", "mean", "loss_aggregation='mean'"),
    ("advantage_estimator", "gae", "advantage_estimator='gae'"),
    ("is_level", "batch", "is_level='batch'"),
    ("proximal_logprobs", "rollout", "proximal_logprobs='rollout'"),
    ("ppo_minibatches", 3, "ppo_minibatches=3"),
    ("tis_cap", 0.0, "tis_cap"),
    ("mis_low", 3.0, "mis_low"),
    ("dynamic_sampling_max_draws", 0, "dynamic_sampling_max_draws"),
])
def test_loss_choices_are_validated(key, value, match):
  c = base_config()
  c.learner[key] = value
  with pytest.raises(ConfigError, match=match):
    validate(c)


def test_overlong_and_truncation_settings_are_validated():
  c = base_config()
  c.reward.overlong_buffer = c.rollout.max_new_tokens
  with pytest.raises(ConfigError, match="overlong_buffer"):
    validate(c)
  c = base_config()
  c.learner.mask_truncated = True
  c.rollout.length_mode = "answer"
  with pytest.raises(ConfigError, match="mask every completion"):
    validate(c)
  assert "normalize_adv_std" not in base_config().learner  # replaced by advantage_estimator


def test_greedy_eval_is_refused_for_training_with_a_pointer_to_evaluate(tmp_path):
  from jax_dora.runtime import run_training  # pylint: disable=g-import-not-at-top

  c = base_config()
  c.output_dir = str(tmp_path / "run")
  c.eval.greedy = True
  with pytest.raises(ConfigError, match="jax_dora.evaluate --greedy"):
    run_training(c)
  assert not (tmp_path / "run").exists()  # refused before anything started
  c.eval.greedy, c.eval.num_samples = False, 0
  with pytest.raises(ConfigError, match="num_samples=0 must be >= 1"):
    validate(c)
  c.eval.num_samples, c.metrics.wandb_mode = 1, "cloud"
  with pytest.raises(ConfigError, match="wandb_mode='cloud'"):
    validate(c)
