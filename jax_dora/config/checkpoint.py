"""``config.checkpoint`` (run checkpoints) and ``config.snapshots`` (policy versions)."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, field


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(ConfigBlock):
  """Run checkpoints: learner state, prompt-stream position and pending prompts."""

  BLOCK = "checkpoint"

  every_steps: int = field(0, "Save every this many steps (0 = only at the end).")
  max_to_keep: int = field(2, "Run checkpoints kept.")
  resume: bool = field(True, "Resume from the newest checkpoint in <output_dir>/checkpoints.")

  def __post_init__(self):
    if self.every_steps < 0:
      self.fail("every_steps", "must be >= 0")
    if self.max_to_keep < 1:
      self.fail("max_to_keep", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class SnapshotsConfig(ConfigBlock):
  """The versioned parameter snapshots the rollout servers load (Orbax)."""

  BLOCK = "snapshots"

  directory: str = field("", "\"\" = <output_dir>/snapshots.")
  max_to_keep: int = field(
      4, "Versions kept; 0 = every version (benchmarks/time_to_reward.py evaluates them after"
      " the run).")

  verify_every: int = field(
      10, "Every this many versions the learner checks the published snapshot's checksums"
      " against its own parameters at that version (a difference is an integrity violation);"
      " servers verify every snapshot they load. 0 = the learner does not check.")

  def __post_init__(self):
    if self.max_to_keep < 0:
      self.fail("max_to_keep", "must be >= 1, or 0 to keep every version")
    if self.verify_every < 0:
      self.fail("verify_every", "must be >= 0")
