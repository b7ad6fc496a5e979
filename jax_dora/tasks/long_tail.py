"""The long-tailed answer-length distribution shared by all tasks.

Asynchronous RL systems are stressed by the *tail* of the generation-length
distribution: one long rollout holds back a synchronous batch while most
slots sit idle. To reproduce that on a CPU the tasks draw their target answer
length from a truncated discrete power law

    P(L = l) ∝ l ** -alpha,   l in [1, max_len],

so most answers are a handful of characters but a few reach ``max_len``. With
the defaults (``alpha=1.5``, ``max_len=48``) about 83% of lengths are <= 8,
p90 is ~15 and ``max_len`` itself has probability ~0.13%, i.e. it shows up a
handful of times in every few thousand prompts.

Benchmarks call :func:`length_stats` / :func:`empirical_length_stats` to
report the distribution next to their timing numbers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

DEFAULT_ALPHA = 1.5


@functools.lru_cache(maxsize=256)
def _pmf_cached(max_len: int, alpha: float) -> np.ndarray:
  lengths = np.arange(1, max_len + 1, dtype=np.float64)
  w = lengths ** -alpha
  pmf = w / w.sum()
  pmf.setflags(write=False)
  return pmf


@functools.lru_cache(maxsize=256)
def _cdf_cached(max_len: int, alpha: float) -> np.ndarray:
  cdf = np.cumsum(length_pmf(max_len, alpha))
  cdf.setflags(write=False)
  return cdf


def length_pmf(max_len: int, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
  """Returns ``pmf`` with ``pmf[l - 1] = P(L = l)`` for ``l = 1..max_len``."""
  if max_len < 1:
    raise ValueError(f"max_len must be >= 1, got {max_len}")
  if alpha < 0:
    raise ValueError(f"alpha must be >= 0, got {alpha}")
  return _pmf_cached(int(max_len), float(alpha))


def sample_length(
    rng: np.random.Generator, max_len: int, alpha: float = DEFAULT_ALPHA
) -> int:
  """Draws one length in ``[1, max_len]`` from the truncated power law."""
  cdf = _cdf_cached(int(max_len), float(alpha))
  # Inverse-CDF with a single uniform keeps the number of rng draws fixed, so
  # a task's later draws do not shift when max_len changes.
  u = rng.random()
  return int(min(np.searchsorted(cdf, u, side="right"), max_len - 1)) + 1


def _stats_from_pmf(pmf: np.ndarray) -> dict[str, float]:
  lengths = np.arange(1, len(pmf) + 1)
  cdf = np.cumsum(pmf)

  def quantile(q: float) -> int:
    return int(lengths[min(np.searchsorted(cdf, q - 1e-12), len(pmf) - 1)])

  return {
      "mean": float((lengths * pmf).sum()),
      "p50": quantile(0.5),
      "p90": quantile(0.9),
      "p99": quantile(0.99),
      "max": int(len(pmf)),
      "frac_le_8": float(pmf[:8].sum()),
      "p_max": float(pmf[-1]),
  }


def length_stats(max_len: int, alpha: float = DEFAULT_ALPHA) -> dict[str, float]:
  """Analytic summary (mean, p50/p90/p99, share <= 8, P(max)) of the law."""
  return _stats_from_pmf(length_pmf(max_len, alpha))


def empirical_length_stats(
    make_prompt: Callable[[int, np.random.Generator], Any],
    n: int = 5000,
    seed: int = 0,
) -> dict[str, float]:
  """Answer-length summary of ``n`` prompts from ``make_prompt``.

  ``make_prompt`` is a ``Task.make_prompt`` (or a ``TaskMixture``'s); the
  actual answers are measured, so the stats include each task's own caps
  (e.g. ``sort`` is bounded by the prompt length).

  Args:
    make_prompt: ``(sample_id, rng) -> Prompt``.
    n: number of prompts to draw.
    seed: base seed; prompt ``i`` uses ``np.random.default_rng([seed, i])``.

  Returns:
    A dict with ``n, mean, p50, p90, p99, max, frac_le_8``.
  """
  lens = np.array(
      [len(make_prompt(i, np.random.default_rng([seed, i])).answer) for i in range(n)]
  )
  return {
      "n": int(n),
      "mean": float(lens.mean()),
      "p50": float(np.percentile(lens, 50)),
      "p90": float(np.percentile(lens, 90)),
      "p99": float(np.percentile(lens, 99)),
      "max": int(lens.max()),
      "frac_le_8": float((lens <= 8).mean()),
  }
