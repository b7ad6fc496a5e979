"""Rewards: answer extraction, math-verify equivalence, isolation of pathological completions."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from jax_dora.config import base_config
from jax_dora.rewards import RewardScorer, register
from jax_dora.rewards.extract import final_answer, hash_answer, last_boxed, last_number
from jax_dora.types import Prompt

GOLD = Prompt(7, "gsm8k", "q", "72")
HALF = Prompt(8, "math", "q", "\\frac{1}{2}")


@register("test_crash", isolated=True)
def _crash(prompt, completion):  # a verifier that takes its worker down
  os._exit(1)


@register("test_raise")
def _raise(prompt, completion):
  raise RuntimeError("broken verifier")


def test_extraction_hand_cases():
  assert last_boxed("a \\boxed{1} then \\boxed{\\frac{3}{4}} end") == "\\frac{3}{4}"
  assert last_boxed("\\boxed{x^{2}+{1}}") == "x^{2}+{1}"
  assert last_boxed("\\boxed{unclosed") is None
  assert hash_answer("so 5 + 5 = 10\n#### 1,234.") == "1234"
  assert hash_answer("no marker") is None
  assert last_number("it was 3, then -4.5 and 1,000 apples") == "1000"
  assert last_number("none") is None
  assert final_answer("#### 5 but \\boxed{6}") == "6"
  assert final_answer("#### 5 and later 7") == "5"
  assert final_answer("about 12 or 13") == "13"
  assert final_answer("") is None


def test_math_verify_equivalence_and_format():
  with RewardScorer(["math_verify", "format"], [1.0, 0.5], timeout_s=20) as s:
    cases = [
        (GOLD, "The total is 72.\n#### 72", 1.5),  # right and well formatted
        (GOLD, "I think \\boxed{72.0}", 1.5),
        (GOLD, "\\boxed{72} and some rambling", 1.0),  # right, trailing text: no format
        (GOLD, "#### 72 because I said so", 1.0),
        (GOLD, "maybe 71", 0.0),
        (GOLD, "no digits", 0.0),
        (HALF, "so \\boxed{0.5}", 1.5),
        (HALF, "$\\boxed{\\frac{2}{4}}$", 1.5),
        (HALF, "\\boxed{\\frac{1}{3}}", 0.5),  # wrong but formatted
    ]
    for prompt, completion, want in cases:
      assert s.score_blocking(prompt, completion) == pytest.approx(want), completion
    assert s.metrics() == {}


def test_pathological_completion_times_out_scores_zero_and_is_counted():
  """A power tower makes sympy run for minutes: the worker is killed at the deadline,
  the term scores 0, the counter says so, and the scorer keeps working."""
  with RewardScorer(["math_verify"], timeout_s=3, num_workers=2) as s:
    s.score_blocking(GOLD, "#### 72")  # workers up, imports done

    async def main():
      return await asyncio.gather(
          s.score(GOLD, "\\boxed{9^{9^{9^{9^{9}}}}}"), s.score(GOLD, "#### 72"),
          s.score(GOLD, "#### 70"))

    t0 = time.time()
    results = asyncio.run(main())
    assert results == [0.0, 1.0, 0.0]
    assert time.time() - t0 < 30
    assert s.metrics() == {"reward/math_verify/timeouts": 1}
    assert s.score_blocking(GOLD, "\\boxed{72}") == 1.0


def test_crashing_and_raising_verifiers_score_zero_and_are_counted():
  with RewardScorer(["test_crash", "test_raise", "format"], timeout_s=20) as s:
    assert s.score_blocking(GOLD, "#### 72") == 1.0  # only format scores
    assert s.metrics() == {"reward/test_crash/crashes": 1, "reward/test_raise/errors": 1}


def test_task_reward_scores_synthetic_prompts():
  with RewardScorer.from_config(base_config().reward) as s:
    p = Prompt(1, "repeat", "rep 2 ab:", "abab")
    assert s.score_blocking(p, "abab") == 1.0
    assert s.score_blocking(p, "") == 0.0
