"""``config.audit``: what the end-of-run audit re-verifies beyond bookkeeping (issue 28)."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, field


@dataclasses.dataclass(frozen=True)
class AuditConfig(ConfigBlock):
  """The integrity ledger proves bookkeeping; these checks re-derive the data itself."""

  BLOCK = "audit"

  verify_fraction: float = field(
      0.02, "Share of trained trajectories re-verified (and written to"
      " <output_dir>/audit_sample.jsonl for `python -m jax_dora.audit`): their rewards re-scored"
      " from the stored prompt and completion, and each span's behaviour log-probs recomputed"
      " on the learner under the snapshot of the version it claims. A difference is an"
      " integrity violation. 1.0 in tests; 0 = off.")
  label_tolerance: float = field(
      0.0, "Largest mean |stored - recomputed| behaviour log-prob over a span's tokens that"
      " still passes as that version's. 0 = by precision: 1e-3 when learner and servers run"
      " float32 throughout, 1e-2 with bfloat16 activations or server parameters (measured on"
      " the tiny policy by benchmarks/label_audit.py; measure your own model with"
      " `python -m jax_dora.audit RUN_DIR --separation`).")

  label_time_share: float = field(
      0.01, "Largest share of the run's wall-clock the between-step label check may take: one"
      " snapshot restore + forward per checked version, which grows with the model; a version"
      " that would go over is skipped (summary audit.labels_skipped). 1.0 checks every version"
      " (tests); the end-of-run drain is not limited.")

  def __post_init__(self):
    if not 0.0 <= self.verify_fraction <= 1.0:
      self.fail("verify_fraction", "must be in [0, 1]")
    if not 0.0 <= self.label_time_share <= 1.0:
      self.fail("label_time_share", "must be in [0, 1]")
    if self.label_tolerance < 0:
      self.fail("label_tolerance", "must be > 0, or 0 for the precision's default")
