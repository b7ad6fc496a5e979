"""A multi-turn run end to end: the tiny model, real engines, the calculator tool.

``configs/tiny_tools.py`` for a few steps of ``dora_pace``: a random policy
samples the calculator's marker now and then, so some trajectories call the
tool mid-generation. The trained-sample log must pass the audit, every tool
call's observation must be what the tool returns when run again, and every
token a version sampled must carry a span of that one version.
"""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib

from jax_dora.orchestrator.integrity import IntegrityLedger
from jax_dora.evaluate import evaluate_run
from jax_dora.runtime import run_training
from jax_dora.tools import ToolCall, make_tool

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config(tmp_path, mode):
  spec = importlib.util.spec_from_file_location("tiny_tools", ROOT / "configs" / "tiny_tools.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  cfg.mode = mode
  cfg.output_dir = str(tmp_path / mode)
  cfg.total_steps = 3
  cfg.precompile = False
  cfg.progress_bar = False
  cfg.eval.num_prompts = 8
  cfg.eval.every_steps = 0
  cfg.eval.at_start = False
  cfg.learner.groups_per_step = 4
  cfg.learner.group_size = 4
  cfg.rollout.slots = 8
  # Every trained trajectory's labels recomputed (tool observations are context: only the
  # sampled turns are compared) and its reward re-scored.
  cfg.audit.verify_fraction = 1.0
  cfg.audit.label_time_share = 1.0
  return cfg


def test_dora_pace_with_a_calculator_passes_the_audit(tmp_path):
  cfg = _config(tmp_path, "dora_pace")
  summary = run_training(cfg)
  assert summary["steps"] == 3 and summary["integrity_violations"] == []
  assert summary["audit"]["labels_checked"] > 0 and summary["audit"]["rewards_rescored"] == 48
  # The default orchestrator.turn_version=newest: a turn may start on a newer version than
  # the turn before it, never change versions inside a turn.
  ledger = IntegrityLedger.from_log(pathlib.Path(cfg.output_dir) / "trained_samples.jsonl",
                                    group_size=4, max_staleness=cfg.orchestrator.max_staleness,
                                    allow_turn_hops=True)
  assert ledger.check() == []
  trained = ledger.trained_records()
  calls = [c for r in trained for c in r.get("tool_calls", [])]
  assert calls, "a random policy should have hit the calculator's '=' in 48 trajectories"
  calculator = make_tool("calculator")
  for r in trained:
    cuts = sorted(c for span in r.get("context", []) for c in span)
    turns = {}
    for start, _, version in r["spans"]:  # a turn = the sampled spans between two observations
      turns.setdefault(sum(c <= start for c in cuts), set()).add(version)
    assert all(len(v) == 1 for v in turns.values()), r["spans"]  # every turn on one version
    for c in r.get("tool_calls", []):
      if c["call"] is not None and c["observation"] != "tool call limit reached":
        again = asyncio.run(calculator.run(ToolCall("calculator", c["call"])))
        assert again.observation == c["observation"], c
  assert summary["final_eval_reward"] is not None

  # python -m jax_dora.evaluate on the finished run: its own servers, the same tool loop.
  res = evaluate_run(cfg.output_dir, num_prompts=16)
  texts = [x["completion"] for x in res["samples"]]
  assert len(texts) == 16 and 0.0 <= res["eval/reward"] <= 1.0
  called = [t for t in texts if "=[" in t]
  assert called, "a random policy should hit '=' in some of 16 completions"
  for t in texts:
    # Every '=' sampled before the end got the calculator's observation right after it.
    assert all(t[i + 1] == "[" for i, c in enumerate(t[:-1]) if c == "="), t


def test_the_gsm8k_tool_config_runs_on_a_tiny_qwen2(hf_dirs, tmp_path):
  """configs/qwen2_5_0_5b_gsm8k_tir.py on a tiny random Qwen2 with its BPE tokenizer.

  A random policy almost never writes a python block, so the stop string is a
  frequent one here ("e"): turns stop, the python format finds no call, the
  observation says so inside an output fence, and the run goes on; the audit
  must hold on the BPE path (trigger ids over the whole vocabulary, context
  spans of multi-token observations).
  """
  from test_real_model_e2e import real_model_config  # pylint: disable=g-import-not-at-top

  spec = importlib.util.spec_from_file_location(
      "tir", ROOT / "configs" / "qwen2_5_0_5b_gsm8k_tir.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  tir = module.get_config()
  cfg = real_model_config(hf_dirs["qwen2"], tmp_path, "dora_pace")
  cfg.tools = tir.tools
  cfg.tools.stop_strings = "e"
  cfg.tools.max_observation_tokens = 24
  cfg.total_steps = 2
  summary = run_training(cfg)
  assert summary["steps"] == 2 and summary["integrity_violations"] == []
  ledger = IntegrityLedger.from_log(pathlib.Path(cfg.output_dir) / "trained_samples.jsonl",
                                    group_size=4, max_staleness=cfg.orchestrator.max_staleness)
  calls = [c for r in ledger.trained_records() for c in r.get("tool_calls", ())]
  assert calls and all(c["tool"] == "python" for c in calls)
  assert {c["observation"] for c in calls} <= {
      "error: no tool call found before the stop marker", "tool call limit reached"}
