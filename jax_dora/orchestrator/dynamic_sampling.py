"""DAPO dynamic sampling: zero-variance groups never take batch space.

A GRPO group whose members all got the same reward has zero advantage for
every member: training on it spends a batch slot on no gradient (and dilutes
the token-mean loss of the others). With ``learner.dynamic_sampling`` such
groups are dropped once complete, recorded in the integrity ledger with the
reason ``zero_variance`` (so the audit still accounts for every drawn sample),
and the producer draws new prompts in their place.

The number of drops per learner step is bounded
(``learner.dynamic_sampling_max_draws``): when the policy fails (or solves)
every prompt, no group has variance, and an unbounded filter would stall the
run forever; past the bound the step trains what it has.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from jax_dora.types import Trajectory

log = logging.getLogger(__name__)

REASON = "zero_variance"


def is_zero_variance(group: Sequence[Trajectory]) -> bool:
  rewards = np.asarray([t.reward for t in group], np.float64)
  return bool(rewards.size) and float(np.ptp(rewards)) == 0.0


class ZeroVarianceFilter:
  """Picks the groups to drop, within the per-step budget."""

  def __init__(self, enabled: bool, groups_per_step: int, max_draws: int):
    self.enabled = enabled
    self.budget = max(0, int(max_draws) - 1) * int(groups_per_step)
    self.dropped_this_step = 0
    self.accepted_over_budget = 0  # zero-variance groups trained after the budget ran out
    self._warned = False

  def new_step(self) -> None:
    self.dropped_this_step = 0

  def split(self, groups: Sequence[Sequence[Trajectory]]) -> tuple[list, list]:
    """``(keep, drop)``; the order of ``keep`` is that of ``groups``."""
    keep: list = []
    drop: list = []
    for g in groups:
      if self.enabled and is_zero_variance(g):
        if self.dropped_this_step < self.budget:
          self.dropped_this_step += 1
          drop.append(g)
          continue
        self.accepted_over_budget += 1
        if not self._warned:
          self._warned = True
          log.warning("dynamic sampling: %d zero-variance groups dropped this step, the budget"
                      " (learner.dynamic_sampling_max_draws); training the rest as they are",
                      self.dropped_this_step)
      keep.append(g)
    return keep, drop
