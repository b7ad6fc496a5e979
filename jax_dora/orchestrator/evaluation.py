"""Held-out evaluation: mean reward, pass@k and maj@k of a policy on fixed prompts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_dora.metrics.passk import sample_metrics
from jax_dora.orchestrator.dispatch import EVAL_TAG
from jax_dora.orchestrator.collector import TrajectoryCollector
from jax_dora.rewards.extract import hash_answer, last_boxed
from jax_dora.types import Prompt


def vote_key(completion: str) -> str:
  """What maj@k votes on: the ``\\boxed{}`` or ``#### N`` answer, else the whole completion.

  The synthetic tasks' completions are their answers; math completions are
  compared by their final answer, not by their reasoning.
  """
  return last_boxed(completion) or hash_answer(completion) or completion.strip()


def length_budget(tokenizer: Any, max_new_tokens: int, fixed_lengths: bool,
                  p: Prompt) -> tuple[int, bool]:
  """``(max_new_tokens, ignore_eos)`` of a request on ``p`` (``rollout.length_mode``).

  ``fixed_lengths`` (length_mode=answer): exactly the reference answer's
  length, EOS ignored; otherwise up to ``max_new_tokens``, stopping at EOS.
  """
  if not fixed_lengths:
    return max_new_tokens, False
  n = len(tokenizer.encode(p.answer, is_bos=False)[0])
  return max(1, min(n, max_new_tokens)), True


class Evaluator:
  """Scores ``num_samples`` completions per held-out prompt at the newest version.

  Eval requests are tagged ``"eval"``, which the dispatcher never aborts on a
  publish; any other abort (a server shutting down) re-runs the sample from
  scratch, so a truncated completion is never scored. Sample ``i`` of a
  prompt is request member ``i`` (distinct request ids, independent samples).
  """

  def __init__(
      self,
      prompts: Sequence[Prompt],
      dispatcher: Any,
      scorer: Any,
      tokenizer: Any,
      length_budget: Callable[[Prompt], tuple[int, bool]],
      *,
      num_samples: int = 1,
      correct_threshold: float = 1.0,
      tool_loop: Any = None,
  ):
    self.prompts = list(prompts)
    self._scorer = scorer
    self._tokenizer = tokenizer
    self._length_budget = length_budget
    self.num_samples = int(num_samples)
    self.correct_threshold = float(correct_threshold)
    # The training turn loop (multi-turn: the same tool as training; None = single-turn).
    self._collector = TrajectoryCollector(dispatcher, tool_loop, tag=EVAL_TAG,
                                          on_restart=self._rerun)
    self.last_stderr: float | None = None
    # eval/pass@1, eval/pass@k, eval/maj@k, eval/reward (+ _stderr) of the last evaluation.
    self.last_metrics: dict[str, float | None] = {}
    # (sample id, finish reason, completion length) of every scored completion.
    self.last_completions: list[tuple[int, str, int]] = []
    # (sample id, member, completion text, reward) of every scored completion.
    self.last_samples: list[tuple[int, int, str, float]] = []
    self.reruns = 0

  async def evaluate(self) -> float | None:
    """Mean reward over the prompts' samples (None without prompts); see ``last_metrics``."""
    if not self.prompts:
      return None
    finished: list[tuple[int, str, int]] = []
    samples: list[tuple[int, int, str, float]] = []

    async def one(p: Prompt, member: int) -> tuple[float, str]:
      budget, ignore_eos = self._length_budget(p)
      tokens = np.asarray(self._tokenizer.encode_prompt(p.text), np.int32)
      # A trajectory that cannot finish as one sample (a server gone) starts over.
      res = await self._collector.collect(p, tokens, member, budget, ignore_eos=ignore_eos,
                                          hold=f"{EVAL_TAG}-{p.sample_id}-{member}",
                                          on_abort="restart")
      finished.append((p.sample_id, res.finish_reason, len(res.completion_tokens)))
      text = self._tokenizer.decode(np.asarray(res.completion_tokens).tolist())
      reward = float(await self._scorer.score(p, text))
      samples.append((p.sample_id, member, text, reward))
      return reward, vote_key(text)

    k = self.num_samples
    out = await asyncio.gather(*(one(p, m) for p in self.prompts for m in range(k)))
    rewards = [[r for r, _ in out[i * k:(i + 1) * k]] for i in range(len(self.prompts))]
    answers = [[a for _, a in out[i * k:(i + 1) * k]] for i in range(len(self.prompts))]
    self.last_completions = sorted(finished)
    self.last_samples = sorted(samples)
    m = sample_metrics(rewards, answers, self.correct_threshold)
    self.last_metrics = {f"eval/{name}": v for name, v in m.items()}
    self.last_metrics.update(self._per_task(rewards, answers))
    # Standard error of the mean over prompts: what a difference between two
    # evals (two modes, two checkpoints) has to exceed to mean anything.
    self.last_stderr = m["reward_stderr"]
    return m["reward"]

  def _rerun(self, sample_id: int, member: int, why: str) -> None:
    del sample_id, member, why
    self.reruns += 1

  def _per_task(self, rewards: list[list[float]], answers: list[list[str]]
                ) -> dict[str, float | None]:
    """``eval/<group>/reward``, ``/pass@1`` (and ``/pass@k``, + stderr) per task or row group.

    A mixture's mean hides which task moved: a curriculum task learned fast
    can mask the task the run is for (the tool workload mixes ``repeat`` in).
    Prompts of a file dataset split by ``data.eval_group_field`` (their
    ``meta["group"]``, e.g. ``difficulty=3``) instead.
    """
    def group(p: Prompt) -> str:
      return p.meta.get("group") or p.task

    groups = sorted({group(p) for p in self.prompts})
    if len(groups) < 2:
      return {}
    out: dict[str, float | None] = {}
    k = self.num_samples
    names = ["reward", "pass@1"] + ([f"pass@{k}"] if k > 1 else [])
    for g in groups:
      rows = [i for i, p in enumerate(self.prompts) if group(p) == g]
      m = sample_metrics([rewards[i] for i in rows], [answers[i] for i in rows],
                         self.correct_threshold)
      for name in names:
        out[f"eval/{g}/{name}"] = m[name]
        out[f"eval/{g}/{name}_stderr"] = m[f"{name}_stderr"]
    return out
