"""pass@k and maj@k over k sampled completions per prompt, with standard errors.

A mean reward hides what sampling buys: a policy that solves a prompt one
time in four scores like one that half-solves it every time. pass@k (does
any of k samples solve it) and maj@k (does the majority answer solve it) are
what reasoning evaluations report, so the held-out eval reports them too.

pass@k uses the unbiased estimator of Chen et al. (2021, "Evaluating Large
Language Models Trained on Code"): with ``n >= k`` samples of which ``c`` are
correct, ``pass@k = 1 - C(n - c, k) / C(n, k)``, computed exactly with
integer binomials. Standard errors are over prompts (``std(ddof=1) /
sqrt(P)``): what a difference between two evaluations has to exceed.

maj@k votes over the answers of the first ``k`` samples. A tie between the
most frequent answers is broken uniformly at random *in expectation*: the
prompt scores the mean correctness of the tied answers (two answers tied, one
right: 0.5). That is deterministic, unbiased, and does not depend on the
order the samples happened to finish in.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one prompt with ``c`` correct out of ``n`` samples."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: Sequence[Hashable], correct: Sequence[bool]) -> float:
  """maj@k of one prompt: correctness of the most frequent answer (ties: their mean).

  An answer's correctness is the share of its samples judged correct (equal
  answers are normally judged alike).
  """
  if len(answers) != len(correct) or not answers:
    raise ValueError(f"maj@k needs one correctness per answer, got {len(answers)} answers and"
                     f" {len(correct)} judgements")
  votes = collections.Counter(answers)
  top = max(votes.values())
  tied = [a for a, v in votes.items() if v == top]
  share = [float(np.mean([ok for a2, ok in zip(answers, correct) if a2 == a])) for a in tied]
  return float(np.mean(share))


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float | None]:
  """Mean over prompts and its standard error (None with fewer than two prompts)."""
  x = np.asarray(values, np.float64)
  if x.size == 0:
    raise ValueError("no values")
  se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else None
  return float(x.mean()), se


def sample_metrics(rewards: Sequence[Sequence[float]], answers: Sequence[Sequence[Hashable]],
                   correct_threshold: float) -> dict[str, float | None]:
  """pass@1, pass@k, maj@k and mean reward (each with ``_stderr``) over prompts.

  ``rewards[p][i]`` / ``answers[p][i]``: reward and vote key of sample ``i``
  of prompt ``p``; every prompt has the same ``k`` samples. A sample is
  correct when its reward is at least ``correct_threshold``.
  """
  ks = {len(r) for r in rewards}
  if len(ks) != 1 or len(answers) != len(rewards):
    raise ValueError(f"every prompt needs the same number of samples and answers, got {sorted(ks)}")
  (k,) = ks
  per: dict[str, list[float]] = collections.defaultdict(list)
  for r, a in zip(rewards, answers):
    ok = [float(x) >= correct_threshold for x in r]
    per["reward"].append(float(np.mean(r)))
    per["pass@1"].append(pass_at_k(k, sum(ok), 1))
    if k > 1:
      per[f"pass@{k}"].append(pass_at_k(k, sum(ok), k))
    per[f"maj@{k}"].append(majority_correct(a, ok))
  out: dict[str, float | None] = {}
  for name, vals in per.items():
    out[name], out[f"{name}_stderr"] = mean_and_stderr(vals)
  return out
