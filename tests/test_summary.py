"""The end-of-run screen: which label the eval line gets and what the rejected-groups line says."""

from __future__ import annotations

from jax_dora.summary import format_summary


def _summary(initial: dict, final: dict, **kw) -> dict:
  return {"mode": "dora_pace", "steps": 30, "wall_time_s": 200.0, "trained_tokens_per_s": 800.0,
          "initial_eval_reward": initial.get("eval/reward"),
          "final_eval_reward": final.get("eval/reward"), "final_eval_reward_stderr": 0.016,
          "initial_eval": initial, "final_eval": final, "integrity_violations": [],
          "rejected_groups": {"stale": 3, "zero_variance": 0}, **kw}


def test_a_binary_reward_is_printed_once_as_held_out_pass_at_1():
  initial = {"eval/reward": 0.224, "eval/pass@1": 0.224, "eval/pass@4": 0.45, "eval/maj@4": 0.3}
  final = {"eval/reward": 0.31, "eval/pass@1": 0.31, "eval/pass@4": 0.5, "eval/maj@4": 0.36,
           "eval/pass@1_stderr": 0.016, "eval/difficulty=1/pass@1": 0.7}
  text = format_summary(_summary(initial, final, trained_groups=480), [])
  line = next(l for l in text.splitlines() if l.startswith("held-out pass@1"))
  assert line == "held-out pass@1    0.224 -> 0.310 (± 0.016); pass@4 0.500, maj@4 0.360"
  assert "eval reward" not in text
  assert "rejected groups    PACE 0, stale 3, zero-variance 0 (trained 480)" in text


def test_a_shaped_reward_keeps_its_label_and_pass_at_1_beside_it():
  initial = {"eval/reward": 0.05, "eval/pass@1": 0.0}
  final = {"eval/reward": 0.2, "eval/pass@1": 0.02, "eval/maj@2": 0.02}
  text = format_summary(_summary(initial, final), [])
  line = next(l for l in text.splitlines() if l.startswith("eval reward"))
  assert line == "eval reward        0.050 -> 0.200 (± 0.016); pass@1 0.000 -> 0.020, maj@2 0.020"
  assert "(trained" not in text  # an old summary without the count
