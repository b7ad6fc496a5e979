"""pass@k / maj@k against hand-computed numbers, and staleness percentiles."""

from __future__ import annotations

import pytest

from jax_dora.metrics.passk import majority_correct, pass_at_k, sample_metrics
from jax_dora.report import percentile


def test_pass_at_k_is_the_unbiased_estimator():
  # n=5 samples, c=2 correct: pass@k = 1 - C(3, k) / C(5, k).
  assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # 1 - 3/5
  assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - 3/10
  assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - 1/10
  assert pass_at_k(5, 2, 4) == 1.0  # fewer than 4 wrong samples: some draw of 4 always hits
  assert pass_at_k(5, 0, 5) == 0.0
  assert pass_at_k(4, 4, 1) == 1.0
  with pytest.raises(ValueError, match="k <= n"):
    pass_at_k(3, 1, 4)
  with pytest.raises(ValueError, match="c <= n"):
    pass_at_k(3, 4, 1)


def test_majority_vote_and_its_tie_rule():
  assert majority_correct(["7", "7", "9"], [False, False, True]) == 0.0  # the majority is wrong
  assert majority_correct(["7", "9", "9"], [False, True, True]) == 1.0
  # Two answers tied two-two, one right: a uniform tie-break is right half the time.
  assert majority_correct(["7", "9", "7", "9"], [True, False, True, False]) == 0.5
  # Three-way tie, one right.
  assert majority_correct(["a", "b", "c"], [False, True, False]) == pytest.approx(1 / 3)
  with pytest.raises(ValueError, match="one correctness per answer"):
    majority_correct(["a"], [True, False])


def test_sample_metrics_over_prompts_with_standard_errors():
  # Prompt 1: one of two samples right (answers differ: a maj@2 tie); prompt 2: both right.
  m = sample_metrics([[1.0, 0.2], [1.0, 1.0]], [["x", "y"], ["z", "z"]], correct_threshold=1.0)
  # Per prompt pass@1 = [0.5, 1.0]: mean 0.75, stderr = std([.5, 1], ddof=1) / sqrt(2) = 0.25.
  assert m["pass@1"] == pytest.approx(0.75) and m["pass@1_stderr"] == pytest.approx(0.25)
  assert m["pass@2"] == 1.0 and m["pass@2_stderr"] == 0.0
  assert m["maj@2"] == pytest.approx(0.75) and m["maj@2_stderr"] == pytest.approx(0.25)
  # Mean reward per prompt [0.6, 1.0]: mean 0.8, stderr 0.2.
  assert m["reward"] == pytest.approx(0.8) and m["reward_stderr"] == pytest.approx(0.2)
  single = sample_metrics([[0.3]], [["a"]], correct_threshold=0.25)
  assert single == {"reward": 0.3, "reward_stderr": None, "pass@1": 1.0, "pass@1_stderr": None,
                    "maj@1": 1.0, "maj@1_stderr": None}
  with pytest.raises(ValueError, match="same number of samples"):
    sample_metrics([[1.0], [1.0, 0.0]], [["a"], ["a", "b"]], correct_threshold=1.0)


def test_staleness_percentiles_are_nearest_rank():
  counts = {0: 50, 1: 45, 2: 5}
  assert percentile(counts, 50) == 0  # the 50th of 100 samples is in bucket 0
  assert percentile(counts, 95) == 1
  assert percentile(counts, 99) == 2
  assert percentile({}, 50) is None


def test_a_mixed_held_out_set_reports_each_task_apart():
  from jax_dora.orchestrator.evaluation import Evaluator  # pylint: disable=g-import-not-at-top
  from jax_dora.types import Prompt  # pylint: disable=g-import-not-at-top
  prompts = [Prompt(0, "mul", "m", "1"), Prompt(1, "repeat", "r", "2"), Prompt(2, "mul", "m", "3")]
  ev = Evaluator(prompts, None, None, None, lambda p: (8, False))
  m = ev._per_task([[1.0, 0.5], [0.5, 0.5], [0.0, 0.0]], [["a", "b"], ["c", "c"], ["d", "d"]])
  assert m["eval/mul/reward"] == 0.375 and m["eval/repeat/reward"] == 0.5
  assert m["eval/mul/pass@1"] == 0.25 and m["eval/repeat/pass@1"] == 0.0
  assert Evaluator(prompts[:1], None, None, None, lambda p: (8, False))._per_task(
      [[1.0, 0.5]], [["a", "b"]]) == {}  # one task: the overall numbers say it all
