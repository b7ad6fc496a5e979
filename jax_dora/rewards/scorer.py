"""Weighted sum of named reward functions, with isolated ones in worker processes.

``RewardScorer.score`` is what the orchestrator awaits for every finished
trajectory and eval completion. In-process functions (the synthetic tasks'
verifier, ``format``) run inline; ``isolated`` ones (``math_verify``) run in a
``pebble.ProcessPool`` of spawned workers (never forked: the parent holds
JAX's threads), each call under ``timeout_s``. A call that times out has its
worker killed and replaced; it and a crashed worker or a raising verifier
score 0 for that term, and are counted (``stats``) and logged, so a
pathological completion can neither hang nor crash the run, and the loss of
signal is visible in the metrics.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import multiprocessing
import threading
from collections.abc import Sequence
from typing import Any

from jax_dora.csv_fields import split_csv
from jax_dora.rewards.base import Reward, get_reward
from jax_dora.types import Prompt

_log = logging.getLogger(__name__)
# Warnings for the first few failures per kind, then only the counters.
_MAX_WARNINGS = 5


def _init_worker() -> None:
  """Imports the heavy verifier stack once per worker, outside any call's deadline."""
  import jax_dora.rewards.builtin  # pylint: disable=g-import-not-at-top,unused-import

  try:
    import math_verify  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    pass


def _call_reward(name: str, module: str, prompt: Prompt, completion: str) -> float:
  """Worker-side entry point: imports the module that registers ``name`` (a user's
  own reward module too), then looks the function up by name."""
  import importlib  # pylint: disable=g-import-not-at-top

  import jax_dora.rewards.builtin  # pylint: disable=g-import-not-at-top,unused-import

  importlib.import_module(module)
  return float(get_reward(name).fn(prompt, completion))


class RewardScorer:
  """Scores completions with ``sum_i weight_i * reward_i(prompt, completion)``.

  Args:
    names: Registered reward names (``jax_dora.rewards.reward_names()``).
    weights: One per name (default all 1.0).
    timeout_s: Deadline of one isolated call, counted from when a worker
      starts it (queueing does not count).
    num_workers: Worker processes for isolated rewards (started lazily, on
      the first isolated call).
  """

  def __init__(
      self,
      names: Sequence[str],
      weights: Sequence[float] | None = None,
      timeout_s: float = 10.0,
      num_workers: int = 2,
  ):
    names = list(names)
    if not names:
      raise ValueError("config.reward.functions names no reward function")
    self.rewards: list[Reward] = [get_reward(n) for n in names]
    w = [1.0] * len(names) if not weights else [float(x) for x in weights]
    if len(w) != len(names):
      raise ValueError(f"{len(names)} reward functions but {len(w)} weights")
    self.weights = w
    if timeout_s <= 0:
      raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
    self.timeout_s = float(timeout_s)
    self.num_workers = max(1, int(num_workers))
    self.stats: collections.Counter[str] = collections.Counter()
    self._pool = None
    self._lock = threading.Lock()

  @classmethod
  def from_config(cls, reward: Any) -> "RewardScorer":
    """From the run config's ``reward`` block (``jax_dora.config.RewardConfig``).

    Not imported here: the config block checks reward names against this
    package's registry, so this package must not import the config.
    """
    return cls(split_csv(reward.functions), split_csv(reward.weights, float) or None,
               timeout_s=reward.timeout_s, num_workers=reward.num_workers)

  # ------------------------------------------------------------------ pool
  def _get_pool(self):
    with self._lock:
      if self._pool is None:
        import pebble  # pylint: disable=g-import-not-at-top

        self._pool = pebble.ProcessPool(
            max_workers=self.num_workers,
            initializer=_init_worker,
            context=multiprocessing.get_context("spawn"),
        )
      return self._pool

  def _schedule(self, reward: Reward, prompt: Prompt, completion: str) -> concurrent.futures.Future:
    return self._get_pool().schedule(
        _call_reward, args=(reward.name, reward.fn.__module__, prompt, completion),
        timeout=self.timeout_s)

  def _failed(self, reward: Reward, kind: str, prompt: Prompt, err: BaseException | str) -> float:
    key = f"{reward.name}/{kind}"
    self.stats[key] += 1
    if self.stats[key] <= _MAX_WARNINGS:
      _log.warning("reward %s %s on sample %d (scored 0; %d so far): %s", reward.name, kind,
                   prompt.sample_id, self.stats[key], err)
    return 0.0

  def _settle(self, reward: Reward, prompt: Prompt, get) -> float:
    from pebble import ProcessExpired  # pylint: disable=g-import-not-at-top

    try:
      return float(get())
    except concurrent.futures.TimeoutError:
      return self._failed(reward, "timeouts", prompt, f"no answer within {self.timeout_s}s")
    except ProcessExpired as e:
      return self._failed(reward, "crashes", prompt, e)
    except Exception as e:  # pylint: disable=broad-exception-caught
      return self._failed(reward, "errors", prompt, f"{type(e).__name__}: {e}")

  def _inline(self, reward: Reward, prompt: Prompt, completion: str) -> float:
    try:
      return float(reward.fn(prompt, completion))
    except Exception as e:  # pylint: disable=broad-exception-caught
      return self._failed(reward, "errors", prompt, f"{type(e).__name__}: {e}")

  # ---------------------------------------------------------------- scoring
  async def score(self, prompt: Prompt, completion: str) -> float:
    """The weighted reward; isolated terms are awaited without blocking the loop."""
    self.stats["calls"] += 1
    pending = {i: self._schedule(r, prompt, completion)
               for i, r in enumerate(self.rewards) if r.isolated}
    total = 0.0
    for i, (r, w) in enumerate(zip(self.rewards, self.weights)):
      if i in pending:
        fut = asyncio.wrap_future(pending[i])
        try:
          await asyncio.wait([fut])
        except asyncio.CancelledError:
          pending[i].cancel()
          raise
        value = self._settle(r, prompt, fut.result)
      else:
        value = self._inline(r, prompt, completion)
      total += w * value
    return total

  def score_blocking(self, prompt: Prompt, completion: str) -> float:
    """:meth:`score` for callers without an event loop (CLIs, tests)."""
    return asyncio.run(self.score(prompt, completion))

  def metrics(self) -> dict[str, int]:
    """Cumulative failure counters, e.g. ``reward/math_verify/timeouts``."""
    return {f"reward/{k}": v for k, v in sorted(self.stats.items()) if k != "calls"}

  def close(self) -> None:
    with self._lock:
      pool, self._pool = self._pool, None
    if pool is not None:
      pool.stop()
      pool.join(timeout=10)

  def __enter__(self) -> "RewardScorer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
