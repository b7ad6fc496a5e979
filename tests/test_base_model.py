"""The shipped base model: transformers loads it and agrees with our import, and it can do arithmetic.

Oracles: ``transformers``' Qwen3 forward for the logits, its own ``generate``
(greedy) and chat template for the answer, and a hand-computed sum.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax_dora.base_model import SHIPPED_MODEL
from jax_dora.model import Transformer
from jax_dora.model.hf_checkpoint import load_params, model_config_from_checkpoint, open_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _transformers_model():
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype="float32").eval()
  return model, transformers.AutoTokenizer.from_pretrained(SHIPPED_MODEL)


def test_shipped_model_logits_equal_transformers():
  import torch

  model, tok = _transformers_model()
  text = tok.apply_chat_template(
      [{"role": "user", "content": "Ava has 40 coins. She loses 7 coins. How many coins does Ava"
                                   " have now?"}], add_generation_prompt=True, tokenize=False)
  ids = np.asarray([tok(text, add_special_tokens=False)["input_ids"]])
  ckpt = open_checkpoint(SHIPPED_MODEL)
  cfg = model_config_from_checkpoint(ckpt, max_seq_len=256)
  assert ckpt.family.name == "qwen3"
  params = load_params(ckpt, cfg, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  ours = Transformer(cfg).apply({"params": params}, ids, np.arange(ids.shape[1])[None])
  with torch.no_grad():
    ref = model(torch.as_tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=1e-4)


def test_shipped_model_reads_one_step_problems():
  """Greedy answers, decoded by transformers itself: the first line restates the question's
  operation (hand-written), and the answer line names that line's result or, the noisy
  teacher's habit (jax_dora.data.word_problems), one of its operands; 12 + 5 = 17 is right.
  Its arithmetic and the miscopied answers are what RL has room to improve."""
  import torch

  model, tok = _transformers_model()
  cases = {
      "Mia has 12 apples. She buys 5 more apples. How many apples does Mia have now?": "12 + 5 =",
      "Ava has 40 coins. She loses 7 coins. How many coins does Ava have now?": "40 - 7 =",
      "Leo has 9 marbles. He finds 6 more marbles. How many marbles does Leo have now?": "9 + 6 =",
      "Nora owns 24 eggs. She splits the eggs equally into 4 groups and keeps one group. How"
      " many eggs does Nora have now?": "24 / 4 =",
  }
  answers = {}
  for question, restated in cases.items():
    ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
      out = model.generate(**ids, max_new_tokens=24, do_sample=False,
                           eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    first, last = answer.split("\n")[0], answer.split("\n")[-1]
    a, _, b, _, result = first.split()
    assert first.startswith(restated) and last in (f"#### {result}", f"#### {a}", f"#### {b}"), answer
    answers[question] = answer
  assert answers[next(iter(cases))].startswith("12 + 5 = 17\n#### ")


def test_tiny_math_config_resolves_the_shipped_policy():
  from jax_dora.config import validate
  from jax_dora.policy import resolve_policy

  spec = importlib.util.spec_from_file_location("tiny_math", ROOT / "configs" / "tiny_math.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  cfg = validate(mod.get_config())
  policy = resolve_policy(cfg)
  assert policy.hf_path == SHIPPED_MODEL and policy.model_cfg.n_layers == 4
  assert policy.tokenizer.decode(policy.tokenizer.encode_ids("12 + 5 = 17")) == "12 + 5 = 17"


@pytest.mark.slow
def test_main_job_learns_with_a_small_bubble_and_few_stale_groups(tmp_path):
  """The README's second command (about five minutes): dora_pace from the shipped base.

  Item 6 of issue 36, as a new user would see it: held-out pass@1 rises by
  more than its noise (one seed, 200 problems x 4 samples, standard error
  ~0.02), the learner is rarely idle (bubble <= 0.15), at most 5% of the
  trained groups' count were evicted as stale, and the integrity audit is clean.
  """
  from jax_dora.metrics.jsonl import read_metrics  # pylint: disable=g-import-not-at-top
  from jax_dora.report import headline  # pylint: disable=g-import-not-at-top

  out = tmp_path / "main_job"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run(
      [sys.executable, "-m", "jax_dora.train", f"--config.output_dir={out}",
       "--config.progress_bar=False"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  before, after = summary["initial_eval"]["eval/pass@1"], summary["final_eval"]["eval/pass@1"]
  assert after - before >= 0.06, (before, after)
  h = headline(read_metrics(out / "metrics.jsonl"), summary)
  assert h["bubble"] <= 0.15, h
  assert summary["rejected_groups"]["stale"] <= 0.05 * summary["trained_groups"], summary
  assert not summary["integrity_violations"]
  assert "held-out pass@1" in proc.stdout
