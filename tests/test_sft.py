"""Supervised fine-tuning: the loss, the rows, bad input, and a short real run end to end.

The end-to-end run starts from a random initial checkpoint written by
``python -m jax_dora.base_model`` (tiny architecture, a BPE trained on the
generated problems), trains a few steps with ``jax_dora.sft_trainer`` (real
Orbax checkpoints and snapshots, an embedded rollout server for greedy
accuracy) and exports. The oracle for the export is ``transformers``: it loads
the directory and its log-probs of a held-out row, tokenized by
``transformers``' own chat template, equal the learner's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil

import numpy as np
import pytest

from jax_dora.config import ConfigError
from jax_dora.data.files import DatasetError
from jax_dora.data.sft import OVERLONG, SftRow, SftRows, SftStream, pack_batch, read_sft_table, tokenize_rows
from jax_dora.learner.losses import LossSettings, policy_loss
from jax_dora.learner.train_state import batch_shapes

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, qk_norm=True,
            tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-6)


def _config(name: str):
  spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """Small word-problem files, a tokenizer and a tiny random initial checkpoint."""
  from jax_dora.base_model.__main__ import main

  root = tmp_path_factory.mktemp("base_model")
  main([f"--data={root / 'data'}", f"--init={root / 'init'}", f"--tokenizer={root / 'tok'}",
        "--scale=0.01", "--tokenizer_rows=600", f"--architecture={json.dumps(TINY)}"])
  return root


def _sft_config(base, out, **overrides):
  c = _config("base_model_sft")
  c.model.hf_path = str(base / "init")
  c.data.train_files = str(base / "data" / "sft_train.jsonl")
  c.data.eval_files = str(base / "data" / "test.jsonl")
  c.output_dir = str(out)
  c.precompile = False
  c.progress_bar = False
  c.metrics.tensorboard = False
  c.total_steps = 16
  c.log_every = 4
  c.eval.every_steps = 8
  c.eval.num_prompts = 4
  c.sft.batch_size = 16
  c.sft.eval_loss_rows = 6
  c.learner.update(dict(learning_rate=3e-3, warmup_steps=2, lr_decay_steps=14,
                        micro_batch_size=8, seq_len_buckets="128,192,256"))
  for key, value in overrides.items():
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c


def test_sft_objective_is_the_masked_token_cross_entropy():
  """logp -1, -2, -3 with the first (prompt) token masked: (2 + 3) / 2 = 2.5 nats."""
  import jax.numpy as jnp

  from jax_dora.config import base_config

  cfg = base_config()
  cfg.learner.loss = "sft"
  settings = LossSettings.from_config(cfg.learner, default_norm_length=8)
  logp = jnp.array([[-1.0, -2.0, -3.0]])
  out = policy_loss(logp, jnp.zeros_like(logp), jnp.ones((1,)), jnp.array([[0.0, 1.0, 1.0]]),
                    settings)
  assert float(out.loss) == pytest.approx(2.5)


def test_pack_batch_masks_the_prompt_by_hand():
  shapes = batch_shapes(2, 8)
  template = {k: np.zeros(s, d) for k, (s, d) in shapes.items()}
  batch = pack_batch([SftRow(np.array([5, 6, 7, 8, 9], np.int32), 2)], template, pad_id=0)
  np.testing.assert_array_equal(batch["inputs"][0], [5, 6, 7, 8, 0, 0, 0])
  np.testing.assert_array_equal(batch["targets"][0], [6, 7, 8, 9, 0, 0, 0])
  # Position 1 (token 6, the prompt's last) predicts 7, the first target token.
  np.testing.assert_array_equal(batch["mask"][0], [0, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(batch["advantages"], [1, 0])
  assert not batch["mask"][1].any()  # an unused row trains nothing


def test_stream_resumes_with_the_same_batches():
  rows = SftRows([np.array([i, i + 1]) for i in range(20)], [1] * 20, [str(i) for i in range(20)], {})
  a = SftStream(rows, 4, seed=3)
  for _ in range(7):  # past the first epoch (5 batches)
    a.next_batch()
  state = a.get_state()
  expect = [[int(row.ids[0]) for row in a.next_batch()] for _ in range(3)]
  b = SftStream(rows, 4, seed=3)
  b.set_state(state)
  assert [[int(row.ids[0]) for row in b.next_batch()] for _ in range(3)] == expect
  with pytest.raises(DatasetError, match="cannot fill one batch"):
    SftStream(rows, 32, seed=0)


def test_bad_rows_are_counted_or_stop_the_run(base, tmp_path):
  from jax_dora.config import validate
  from jax_dora.policy import resolve_policy

  bad = tmp_path / "bad.jsonl"
  good = [json.loads(line) for line in (base / "data" / "test.jsonl").read_text().splitlines()[:3]]
  rows = good + [{"question": "No target here?"}, {"question": "Empty?", "answer": ""},
                 {"question": "Long?", "answer": "1 + 1 = 2\n" * 200 + "#### 2"}]
  bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
  cfg = validate(_sft_config(base, tmp_path / "run", **{"data.train_files": str(bad)}))
  tokenizer = resolve_policy(cfg).tokenizer
  out = tokenize_rows(read_sft_table(cfg, str(bad)), tokenizer, cfg.model.max_seq_len)
  assert len(out) == 3
  assert out.skipped == {"no answer field 'answer'": 2, OVERLONG: 1}
  strict = validate(_sft_config(base, tmp_path / "run", **{"data.train_files": str(bad),
                                                           "data.on_bad_row": "error"}))
  with pytest.raises(DatasetError, match=r"bad.jsonl:4: no answer field"):
    read_sft_table(strict, str(bad))
  long_only = tmp_path / "long.jsonl"
  long_only.write_text(json.dumps(rows[-1]) + "\n")
  with pytest.raises(DatasetError, match=r"long.jsonl:1: \d+ tokens > model.max_seq_len=256"):
    tokenize_rows(read_sft_table(strict, str(long_only)), tokenizer, 256, "error")
  # A target field of the config's choosing (a dataset with prompt/completion columns).
  pc = tmp_path / "pc.jsonl"
  pc.write_text(json.dumps({"question": "Q?", "completion": "#### 4"}) + "\n")
  cfg_pc = validate(_sft_config(base, tmp_path / "run", **{"sft.target_field": "completion"}))
  assert read_sft_table(cfg_pc, str(pc))[0]["target"] == "#### 4"


def test_config_errors(base, tmp_path):
  from jax_dora.model.hf_tokenizer import TokenizerLoadError
  from jax_dora.sft_trainer import build_sft_run

  with pytest.raises(ConfigError, match="learner.loss=sft"):
    build_sft_run(_sft_config(base, tmp_path / "a", **{"learner.loss": "grpo"}))
  with pytest.raises(ConfigError, match="needs data.train_files"):
    build_sft_run(_sft_config(base, tmp_path / "b", **{"data.train_files": ""}))
  # A tokenizer without a chat template when the config asks for one.
  plain = tmp_path / "no_template"
  shutil.copytree(base / "init", plain)
  (plain / "chat_template.jinja").unlink()
  tc = json.loads((plain / "tokenizer_config.json").read_text())
  tc.pop("chat_template", None)
  (plain / "tokenizer_config.json").write_text(json.dumps(tc))
  with pytest.raises(TokenizerLoadError, match="no chat template"):
    build_sft_run(_sft_config(base, tmp_path / "c", **{"model.hf_path": str(plain)}))


def test_sft_run_learns_exports_and_transformers_agrees(base, tmp_path):
  import torch
  import transformers

  from jax_dora.sft_trainer import build_sft_run

  run = build_sft_run(_sft_config(base, tmp_path / "run"))
  summary = run.train()
  evals = summary["evals"]
  assert [e["step"] for e in evals] == [0, 8, 16]
  first, last = evals[0]["sft/heldout_loss"], evals[-1]["sft/heldout_loss"]
  assert last < 0.75 * first, evals
  assert "sft/greedy_pass@1" in evals[-1]
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  losses = [r["sft/loss"] for r in records if "sft/loss" in r]
  assert len(losses) == 16 and np.mean(losses[-4:]) < np.mean(losses[:4])

  export = pathlib.Path(summary["export_dir"])
  assert export == tmp_path / "run" / "hf"
  model = transformers.AutoModelForCausalLM.from_pretrained(export).float().eval()
  tok = transformers.AutoTokenizer.from_pretrained(export)
  row = json.loads((base / "data" / "test.jsonl").read_text().splitlines()[0])
  prompt = tok.apply_chat_template([{"role": "user", "content": row["question"]}],
                                   add_generation_prompt=True, tokenize=False)
  prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
  ids = prompt_ids + tok(row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
  with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].numpy().astype(np.float64)
  # The learner never samples suppressed ids (specials that are not stops, padded rows).
  logits = np.where(np.asarray(run.policy.suppress_mask)[None], -np.inf, logits)
  ref = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
  ref_target = ref[np.arange(len(ids) - 1), ids[1:]]
  batch = pack_batch([SftRow(np.asarray(ids, np.int32), len(prompt_ids))],
                     run.learner.batch_template(run.cfg.sft.batch_size, 256), tok.pad_token_id)
  ours = run.learner.logprobs_under(run.learner.params, batch)[0]
  trained = batch["mask"][0] > 0
  assert trained.sum() == len(ids) - len(prompt_ids)
  np.testing.assert_allclose(ours[trained], ref_target[len(prompt_ids) - 1:], atol=2e-4)
  assert os.path.exists(export / "generation_config.json")

  # `python -m jax_dora.evaluate --config`: the exported checkpoint, served from a fresh
  # snapshot, decodes the same greedy answers on the same held-out prompts as the run's
  # own last eval; --group_field splits the metrics by the rows' difficulty.
  from jax_dora.evaluate import evaluate_checkpoint

  cfg = _sft_config(base, tmp_path / "eval", **{"model.hf_path": str(export)})
  res = evaluate_checkpoint(cfg, num_prompts=4, greedy=True, group_field="difficulty")
  assert res["eval/pass@1"] == evals[-1]["sft/greedy_pass@1"]
  groups = {k.split("/")[1] for k in res if k.startswith("eval/difficulty=")}
  rows = [json.loads(line) for line in (base / "data" / "test.jsonl").read_text().splitlines()]
  assert groups and groups <= {f"difficulty={r['difficulty']}" for r in rows}

  # Resume: the same run asked for 4 more steps continues from its step-16 checkpoint (the
  # learner state and the data stream's position), and every step is logged once.
  more = build_sft_run(_sft_config(base, tmp_path / "run", total_steps=20))
  assert more.resumed_step == 16 and more.learner.step == 16
  assert more.train()["steps"] == 20
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "sft/loss" in r] == list(range(1, 21))
