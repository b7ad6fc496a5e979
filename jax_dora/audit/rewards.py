"""The audit's reward check: a sample of trained trajectories re-scored (issue 28, item 2).

The ledger records the reward each trained trajectory carried; nothing
checked that it is what the reward functions give for that completion. A
reward attached to the wrong trajectory, a group's rewards shuffled, a
verifier result cached under the wrong key: each trains on wrong advantages
with every metric looking plausible. So ``audit.verify_fraction`` of the
trained trajectories (the audit sample) are kept (prompt, completion ids, the
verifier's part of the stored reward: the stored reward minus its shaping
term) and, at the end of the run, scored again through the same reward functions (in their
worker pool, under their timeout); a different value is an integrity
violation naming the sample. Verifiers are deterministic functions of
(prompt, completion), so the comparison is exact up to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from jax_dora.types import Trajectory

# Rewards are Python floats from deterministic verifiers: equal up to rounding.
_TOLERANCE = 1e-6


class RewardAudit:
  """Keeps the audit sample's trajectories (``jax_dora.audit.sample``) and re-scores them."""

  def __init__(self):
    self._kept: list[tuple[tuple[int, int], Any, list[int], float]] = []

  def keep(self, trajs: Iterable[Trajectory]) -> None:
    """Called with the audit sample's share of each trained batch."""
    for t in trajs:
      self._kept.append((t.key, t.prompt, np.asarray(t.completion_tokens).tolist(),
                         float(t.reward) - float(t.reward_shaping)))

  async def check(self, scorer: Any, tokenizer: Any) -> tuple[list[str], int]:
    """``(violations, trajectories re-scored)``."""
    out = []
    for key, prompt, ids, stored in self._kept:
      fresh = float(await scorer.score(prompt, tokenizer.decode(ids)))
      if abs(fresh - stored) > _TOLERANCE:
        out.append(f"{key}: trained with reward {stored:.6g} (before shaping), the reward"
                   f" functions give {fresh:.6g} for its stored completion")
    return out, len(self._kept)
