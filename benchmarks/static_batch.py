"""Static batching baseline: what synchronous RL systems do.

A batch of prompts is prefilled, then decoded in lockstep until the *longest*
sequence finishes; only then does the next batch start. Slots whose sequence
ended early sit idle, which is exactly the waste continuous batching (the
:class:`~jax_dora.rollout.driver.RolloutDriver`) removes on long-tailed
length distributions. Built from the same engine pieces (prefill / insert /
generate), so the comparison isolates the scheduling policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jax_dora.rollout.engine import DoraEngine, MultiVersionParams, Params


@dataclasses.dataclass
class StaticResult:
  tokens: np.ndarray  # int32 completion (includes EOS if finished by EOS)
  logprobs: np.ndarray  # float32
  finish_reason: str  # "eos" | "length"


@dataclasses.dataclass
class StaticStats:
  steps: int = 0  # generate calls
  slot_steps: int = 0  # steps x slots in use by a batch (idle finished rows included)
  useful_tokens: int = 0  # tokens actually kept


def static_generate(
    engine: DoraEngine,
    params: Params,
    prompts: Sequence[np.ndarray],
    max_new_tokens: int | Sequence[int],
    *,
    version: int = 0,
    stop_on_eos: bool = True,
    stats: StaticStats | None = None,
) -> list[StaticResult]:
  """Generates completions for ``prompts`` in static batches of ``num_slots``.

  Args:
    engine: The engine (its slot count is the batch size).
    params: Param tree on the engine's devices.
    prompts: int32 token arrays (BOS + prompt).
    max_new_tokens: One budget for all, or one per prompt.
    version: Version id recorded in the decode state (no effect on output).
    stop_on_eos: Whether EOS ends a sequence (see ``RolloutDriver``).
    stats: Optional accumulator for step / utilisation counts.

  Returns:
    One :class:`StaticResult` per prompt, in order.
  """
  n = len(prompts)
  budgets = [int(max_new_tokens)] * n if np.isscalar(max_new_tokens) else [int(b) for b in max_new_tokens]
  stops = frozenset(engine.tokenizer.stop_tokens) if stop_on_eos else frozenset()
  mv = MultiVersionParams.single(version, params)
  b = engine.max_concurrent_decodes
  stats = stats if stats is not None else StaticStats()
  results: list[StaticResult | None] = [None] * n
  for start in range(0, n, b):
    idx = list(range(start, min(start + b, n)))
    state = engine.init_decode_state()
    toks: dict[int, list[int]] = {}
    lps: dict[int, list[float]] = {}
    live: dict[int, int] = {}  # slot -> prompt index, still generating
    for slot, i in enumerate(idx):
      prompt = np.asarray(prompts[i], np.int32)
      budget = min(budgets[i], engine.max_seq_len - len(prompt))
      padded, true_len = engine.pad_tokens(prompt)
      prefix = engine.prefill(params=mv, padded_tokens=padded, true_length=true_len)
      state = engine.insert(prefix, state, slot)
      toks[i], lps[i] = [int(prefix.token)], [float(prefix.logprob)]
      budgets[i] = budget
      live[slot] = i
    finished = {}

    def check(slot: int, i: int) -> None:
      if toks[i][-1] in stops:
        finished[i] = "eos"
      elif len(toks[i]) >= budgets[i]:
        finished[i] = "length"
      if i in finished:
        del live[slot]

    for slot, i in list(live.items()):
      check(slot, i)
    # Lockstep: every step decodes all rows of the batch until the longest
    # is done; rows that already finished keep occupying their slot.
    while live:
      state, res = engine.generate(mv, state)
      res = res.convert_to_numpy()
      stats.steps += 1
      stats.slot_steps += len(idx)
      for slot, i in list(live.items()):
        toks[i].append(int(res.data[slot, 0]))
        lps[i].append(float(res.logprobs[slot, 0]))
        check(slot, i)
    for i in idx:
      stats.useful_tokens += len(toks[i])
      results[i] = StaticResult(np.asarray(toks[i], np.int32), np.asarray(lps[i], np.float32), finished[i])
  return results
