"""``config.orchestrator``: staleness bound, admission and server-failure policy."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, choice, field

# Which version a multi-turn trajectory's next turn runs on (``turn_version``).
TURN_VERSIONS = ("held", "newest")


@dataclasses.dataclass(frozen=True)
class OrchestratorConfig(ConfigBlock):
  """What the host-side orchestrator keeps in flight and how it survives servers."""

  BLOCK = "orchestrator"

  max_staleness: int = field(
      2, "Hard bound: no trajectory is trained more than this many versions after the version"
      " that generated its oldest token.")
  turn_version: str = field(
      "newest", "Multi-turn, in the modes that never move a trajectory to another version (sync,"
      " one_step_off, dora, dora_pace): held = every turn runs on the version the trajectory"
      " started with, pinned on its server through each tool call (intra-trajectory"
      " consistency); newest = each turn starts on the newest version and the turn's version is"
      " released when the tool call starts (a per-turn version hop: intra-turn consistency,"
      " spans of several versions, each turn one). The staleness bound and the importance"
      " corrections apply per span either way (DESIGN.md, Held trajectories).")
  restart_stale_turns: bool = field(
      False, "Multi-turn: at a turn boundary, a trajectory whose oldest sampled token is already"
      " more than max_staleness versions behind the learner starts over instead of running its"
      " next turn: versions only grow, so finished it could only be evicted, taking its whole"
      " group with it (counted: tools/stale_turn_restarts_total).")
  queue_depth: int = field(4, "Requests in flight per server beyond its slots (keeps slots full).")
  max_server_restarts: int = field(
      3, "A rollout server that dies and comes back at the same address (a new process), or"
      " stalls, is re-admitted this many times; then retired. A blip (the same process"
      " answering again) costs nothing.")
  no_server_grace_s: float = field(
      1800.0, "With no live rollout server, requests wait this long for one to come back before"
      " the run fails.")
  async_publish: bool = field(
      True, "Background publishing (modes that declare it: async_unfiltered, dora,"
      " dora_pace): the learner only copies its params and goes on training while the Orbax"
      " write and the servers' load run in the background; versions produced meanwhile are"
      " coalesced to the newest.")
  fill_staleness_budget: bool = field(
      False, "Streaming modes keep in flight only what the servers' slots and queues can work"
      " on. True fills AReaL's whole staleness budget ((max_staleness + 1) batches) instead,"
      " so high max_staleness is actually reached (benchmarks/staleness_sweep.py).")

  def __post_init__(self):
    if self.max_staleness < 0:
      self.fail("max_staleness", "must be >= 0")
    choice(self.BLOCK, "turn_version", self.turn_version, TURN_VERSIONS)
    if self.queue_depth < 0:
      self.fail("queue_depth", "must be >= 0")
    if self.max_server_restarts < 0:
      self.fail("max_server_restarts", "must be >= 0")
    if self.no_server_grace_s <= 0:
      self.fail("no_server_grace_s", "must be > 0")
