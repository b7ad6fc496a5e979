"""End to end on the real-model path: an HF-format Qwen2 (and a Gemma 3: sliding-window and
global layers, a final-logit soft-cap, BOS and ``<end_of_turn>`` conventions) checkpoint, its
BPE tokenizer and chat template, a GSM8K-format JSONL file and the math-verify reward, in ``sync`` and
``dora_pace``, on 8 forced host devices (learner and rollout disjoint), then export.

The model is tiny and random, so rewards are near zero: what is checked is that the
whole path runs and keeps its guarantees (integrity audit clean, every trained
completion free of suppressed ids, prompts built with the chat template, the
exported checkpoint loading in ``transformers`` with the trained weights).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import _hf
import numpy as np
import pytest
from _harness import free_port

from jax_dora.config import base_config, hf_model_config
from jax_dora.orchestrator.integrity import IntegrityLedger, read_log
from jax_dora.runtime import run_training

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gsm8k_file(path: pathlib.Path) -> str:
  rows = [{"question": f"Tom has {i} apples, buys {i % 7 + 1}. Total?",
           "answer": f"{i} + {i % 7 + 1} = {i + i % 7 + 1}\n#### {i + i % 7 + 1}"}
          for i in range(120)]
  rows.append({"question": "a row without an answer"})
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def real_model_config(hf_dir: str, tmp_path: pathlib.Path, mode: str):
  cfg = base_config()
  cfg.mode = mode
  cfg.output_dir = str(tmp_path / mode)
  cfg.total_steps = 3
  cfg.progress_bar = False
  cfg.model = hf_model_config(hf_dir, max_seq_len=160)
  cfg.data.train_files = _gsm8k_file(tmp_path / "gsm8k_train.jsonl")
  cfg.data.format = "gsm8k"
  cfg.data.prompt_template = "chat"
  cfg.data.prompt_suffix = " Answer after ####."
  cfg.data.heldout_fraction = 0.1
  cfg.reward.functions = "math_verify,format"
  cfg.reward.weights = "1.0,0.1"
  cfg.rollout.max_prefill_length = 80
  cfg.rollout.max_new_tokens = 32
  cfg.rollout.slots = 8
  cfg.learner.group_size = 4
  cfg.learner.groups_per_step = 4
  cfg.learner.seq_len_buckets = "128"
  cfg.learner.logprob_chunk_size = 32  # the chunked path, on 3 chunks of a 96-token row
  cfg.learner.micro_batch_size = 8
  cfg.learner.learning_rate = 1e-3
  cfg.eval.num_prompts = 6
  cfg.eval.every_steps = 0
  return cfg


@pytest.mark.parametrize("family,mode", [
    ("qwen2", "sync"), ("qwen2", "dora_pace"),
    # Gemma's path through the run (its head soft-cap in the sampler and the learner, ratio 1,
    # export) is the same in both modes: dora_pace runs in the suite, sync is slow (~25 s).
    pytest.param("gemma3_b", "sync", marks=pytest.mark.slow), ("gemma3_b", "dora_pace")])
def test_hf_model_trains_on_gsm8k_file_with_math_verify(hf_dirs, tmp_path, family, mode):
  cfg = real_model_config(hf_dirs[family], tmp_path, mode)
  if family == "gemma3_b":
    # One key/value head (as Gemma 3 1B) on 2 tensor-parallel chips, learner and servers:
    # the KV heads are replicated on both sides.
    cfg.learner.mesh_tensor = 2
    cfg.rollout.devices_per_server = 2
    cfg.rollout.tensor_parallel = 2
  if mode == "dora_pace":
    # A random policy earns no reward (zero advantages, zero policy gradient):
    # weight decay is what moves its weights, so the export check below can
    # tell the trained policy from the one it started from.
    cfg.learner.weight_decay = 0.1
    cfg.learner.learning_rate = 1e-2
  summary = run_training(cfg)
  assert summary["steps"] == 3
  assert summary["integrity_violations"] == []
  assert summary["data_rows_skipped"] == {"no answer field 'answer'": 1}
  assert summary["reward_failures"] == {}
  run = pathlib.Path(cfg.output_dir)
  ledger = IntegrityLedger.from_log(run / "trained_samples.jsonl", group_size=4,
                                    max_staleness=cfg.orchestrator.max_staleness)
  assert ledger.check() == []
  assert len(ledger.trained_records()) == 3 * 16
  recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs] == [1, 2, 3]
  assert all(np.isfinite(r["train/loss"]) for r in recs)
  if mode == "sync":
    # On-policy first step: the learner's log-probs equal the sampler's (same
    # masked distribution), so every importance ratio is 1.
    assert abs(recs[0]["train/ratio_mean"] - 1.0) < 1e-4
  model_cfg = json.loads((run / "model_config.json").read_text())
  assert model_cfg["hf_path"] == hf_dirs[family]
  assert model_cfg["model"]["n_kv_heads"] == (1 if family == "gemma3_b" else 2)
  if family.startswith("gemma"):
    assert model_cfg["model"]["local_layers"] == [1] and model_cfg["model"]["sliding_window"] == 4
  entries = [e for e in read_log(run / "trained_samples.jsonl") if e.get("event") == "trained"]
  assert entries, "no trained entries in the log"
  if mode == "dora_pace":
    _check_export_loads_in_transformers(run, hf_dirs[family], tmp_path / "exported", version=3)


def _check_export_loads_in_transformers(run: pathlib.Path, start_dir: str, out: pathlib.Path,
                                        version: int) -> None:
  """``python -m jax_dora.export`` on the run: transformers loads the newest policy version
  with our logits for it, tokenizer files included, and it differs from the start."""
  import jax
  import transformers

  from jax_dora.model import ModelConfig, Transformer
  from jax_dora.snapshots import SnapshotReader

  proc = subprocess.run(
      [sys.executable, "-m", "jax_dora.export", f"--run_dir={run}", f"--out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"exported policy version {version}" in proc.stdout
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype="float32")
  tok = transformers.AutoTokenizer.from_pretrained(str(out))
  assert tok.chat_template, "tokenizer files were not exported"
  params, _ = SnapshotReader(run / "snapshots").load(version)
  mcfg = ModelConfig(**json.loads((run / "model_config.json").read_text())["model"])
  tokens = np.arange(10, 40)[None]
  ours = Transformer(mcfg).apply({"params": jax.device_get(params)}, tokens, np.arange(30)[None])
  np.testing.assert_allclose(np.asarray(ours), _hf.reference_logits(model, tokens), atol=2e-5, rtol=1e-4)
  start = transformers.AutoModelForCausalLM.from_pretrained(start_dir, dtype="float32")
  assert not np.allclose(_hf.reference_logits(start, tokens), _hf.reference_logits(model, tokens))


def test_remote_grpc_rollout_server_serves_the_hf_policy(hf_dirs, tmp_path):
  """The pod layout on loopback: a separate rollout-server process started from the HF
  recipe resolves the same policy (architecture, stop and suppressed ids) from
  ``model.hf_path`` and serves the learner over gRPC; the audit stays clean."""
  import os

  port = free_port()
  snaps = tmp_path / "snaps"
  args = [sys.executable, "-m", "jax_dora.rollout.server_main",
          "--config=configs/qwen2_5_0_5b_gsm8k.py", "--host=127.0.0.1", "--grace_s=1",
          f"--config.model.hf_path={hf_dirs['qwen2']}", "--config.model.max_seq_len=160",
          "--config.model.dtype=float32", f"--config.rollout.port={port}",
          f"--config.snapshots.directory={snaps}", "--config.rollout.slots=8",
          "--config.rollout.max_prefill_length=80", "--config.rollout.max_new_tokens=32",
          "--config.rollout.devices_per_server=1", "--config.precompile=False"]
  log = open(tmp_path / "server.log", "wb")
  server = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
  try:
    cfg = real_model_config(hf_dirs["qwen2"], tmp_path, "sync")
    cfg.total_steps = 2
    cfg.eval.num_prompts = 0
    cfg.rollout.server_addresses = f"127.0.0.1:{port}"
    cfg.role = "learner"
    cfg.snapshots.directory = str(snaps)
    summary = run_training(cfg)
    assert summary["steps"] == 2 and summary["integrity_violations"] == [], summary
    recs = [json.loads(line) for line in
            (pathlib.Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    # Same masked distribution on both sides of the wire: on-policy ratios are 1.
    assert abs(recs[0]["train/ratio_mean"] - 1.0) < 1e-4
  finally:
    server.terminate()
    server.wait(30)
    log.close()
  text = (tmp_path / "server.log").read_text(errors="replace")
  assert "policy: qwen2 from" in text and "serving on" in text, text[-3000:]
