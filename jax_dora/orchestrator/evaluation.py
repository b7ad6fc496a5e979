"""Held-out evaluation: mean reward of the newest policy on fixed prompts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_dora.orchestrator.dispatch import EVAL_TAG
from jax_dora.types import Prompt


class Evaluator:
  """Scores one sample per held-out prompt at the newest version.

  Eval requests are tagged ``"eval"``, which the dispatcher never aborts on a
  publish; any other abort (a server shutting down) re-runs the prompt from
  scratch, so a truncated completion is never scored.
  """

  def __init__(
      self,
      prompts: Sequence[Prompt],
      dispatcher: Any,
      scorer: Any,
      tokenizer: Any,
      length_budget: Callable[[Prompt], tuple[int, bool]],
  ):
    self.prompts = list(prompts)
    self._dispatcher = dispatcher
    self._scorer = scorer
    self._tokenizer = tokenizer
    self._length_budget = length_budget
    self.last_stderr: float | None = None
    # (sample id, finish reason, completion length) of every scored completion.
    self.last_completions: list[tuple[int, str, int]] = []
    self.reruns = 0

  async def evaluate(self) -> float | None:
    """Mean reward over the prompts (None without prompts)."""
    if not self.prompts:
      return None
    finished: list[tuple[int, str, int]] = []

    async def one(p: Prompt) -> float:
      budget, ignore_eos = self._length_budget(p)
      tokens = np.asarray(self._tokenizer.encode_prompt(p.text), np.int32)
      while True:
        res = await self._dispatcher.run(p, tokens, 0, budget, tag=EVAL_TAG,
                                         ignore_eos=ignore_eos)
        if res.finish_reason != "aborted":
          break
        self.reruns += 1
      finished.append((p.sample_id, res.finish_reason, len(res.completion_tokens)))
      return float(await self._scorer.score(
          p, self._tokenizer.decode(np.asarray(res.completion_tokens).tolist())))

    rewards = np.asarray(await asyncio.gather(*(one(p) for p in self.prompts)), np.float64)
    self.last_completions = sorted(finished)
    # Standard error of the mean: what a difference between two evals (two
    # modes, two checkpoints) has to exceed to mean anything.
    self.last_stderr = (
        float(rewards.std(ddof=1) / np.sqrt(len(rewards))) if len(rewards) > 1 else None)
    return float(rewards.mean())
