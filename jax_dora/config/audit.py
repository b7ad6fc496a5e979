"""``config.audit``: what the end-of-run audit re-verifies beyond bookkeeping (issue 28)."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, field


@dataclasses.dataclass(frozen=True)
class AuditConfig(ConfigBlock):
  """The integrity ledger proves bookkeeping; these checks re-derive the data itself."""

  BLOCK = "audit"

  verify_fraction: float = field(
      0.02, "Share of trained trajectories re-verified: their rewards re-scored from the stored"
      " prompt and completion through the reward functions (a different value is an integrity"
      " violation). 1.0 in tests; 0 = off.")

  def __post_init__(self):
    if not 0.0 <= self.verify_fraction <= 1.0:
      self.fail("verify_fraction", "must be in [0, 1]")
