"""``config.distributed``: the ``jax.distributed`` cluster of a multi-host run."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, field


@dataclasses.dataclass(frozen=True)
class DistributedConfig(ConfigBlock):
  """Multi-host: learner processes and rollout processes in one cluster (or apart)."""

  BLOCK = "distributed"

  enabled: bool = field(False, "Call jax.distributed.initialize.")
  coordinator_address: str = field("", "host:port of process 0 (\"\" = auto-detect on TPU).")
  num_processes: int = field(-1, "Processes in the cluster (-1 = auto-detect).")
  process_id: int = field(-1, "This process's index (-1 = auto-detect).")
  num_learner_processes: int = field(
      -1, "Processes 0..n-1 are the learner; the others are rollout servers (server_main)"
      " sharing the cluster. -1 = the whole cluster is the learner (a TPU learner slice with"
      " its own cluster; rollout slices run apart).")

  def __post_init__(self):
    if self.num_learner_processes == 0 or self.num_learner_processes < -1:
      self.fail("num_learner_processes", "must be -1 (all) or >= 1")
