"""The whole run config, typed: the top-level fields and every block."""

from __future__ import annotations

import dataclasses
from jax_dora.config.audit import AuditConfig
from jax_dora.config.block import ConfigBlock, choice, field
from jax_dora.config.checkpoint import CheckpointConfig, SnapshotsConfig
from jax_dora.config.data import DataConfig
from jax_dora.config.distributed import DistributedConfig
from jax_dora.config.evaluation import EvalConfig
from jax_dora.config.learner import LearnerConfig
from jax_dora.config.metrics import MetricsConfig
from jax_dora.config.model import ModelBlock
from jax_dora.config.orchestrator import OrchestratorConfig
from jax_dora.config.pace import PaceConfig
from jax_dora.config.reward import RewardConfig
from jax_dora.config.rollout import RolloutConfig
from jax_dora.config.sft import SftConfig
from jax_dora.config.tools import ToolsConfig
from jax_dora.orchestrator.modes import MODES

ROLES = ("all", "learner", "rollout")


@dataclasses.dataclass(frozen=True)
class RunConfig(ConfigBlock):
  """Every setting of a run; ``base_config()`` is ``RunConfig().to_config_dict()``."""

  BLOCK = ""

  mode: str = field("sync", "Training mode (jax_dora.orchestrator.modes): " + ", ".join(MODES) + ".")
  seed: int = field(0, "Seeds parameters, sampling and the dispatcher's jitter.")
  output_dir: str = field("runs/default", "Where metrics, logs, snapshots and checkpoints go.")
  role: str = field(
      "all", "all: learner + embedded rollout servers in one process (Colab / CPU / single"
      " host). learner: the learner and orchestrator only, with remote rollout servers at"
      " rollout.server_addresses. rollout: a rollout server (jax_dora.rollout.server_main).")
  total_steps: int = field(60, "Learner steps (= policy versions published).")
  max_wall_time_s: float = field(
      0.0, "Stop after this many seconds of training wall time even if total_steps is not"
      " reached (0 = no limit). Benchmarks compare modes at equal budgets.")
  log_every: int = field(
      10, "One readable log line (step, reward, bubble, throughput, staleness) every this many"
      " learner steps; 0 = none.")
  precompile: bool = field(
      False, "Compile every shape the run can meet (learner length buckets, rollout prefill"
      " buckets and 1..max_versions live versions) at start-up, so no step stalls on a"
      " compile mid-run. Off for the tests' few-step runs; every configs/*.py run sets it.")
  compile_cache_dir: str = field(
      "auto", "JAX's persistent compilation cache: auto = $JAX_COMPILATION_CACHE_DIR, else"
      " ~/.cache/jax_dora/xla; a path; \"\" = off.")
  progress_bar: bool = field(True, "A tqdm bar on the terminal.")

  model: ModelBlock = dataclasses.field(default_factory=ModelBlock)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  snapshots: SnapshotsConfig = dataclasses.field(default_factory=SnapshotsConfig)
  orchestrator: OrchestratorConfig = dataclasses.field(default_factory=OrchestratorConfig)
  pace: PaceConfig = dataclasses.field(default_factory=PaceConfig)
  reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
  tools: ToolsConfig = dataclasses.field(default_factory=ToolsConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
  metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  audit: AuditConfig = dataclasses.field(default_factory=AuditConfig)
  sft: SftConfig = dataclasses.field(default_factory=SftConfig)

  @property
  def held_kv_rows(self) -> int:
    """``rollout.held_kv_slots`` resolved for this run (-1: a row per slot with a tool)."""
    return self.rollout.held_kv_rows(multi_turn=bool(self.tools.name))

  @property
  def turn_hops(self) -> bool:
    """A multi-turn trajectory's turns may run on different versions, one each
    (``orchestrator.turn_version=newest`` with a tool): what the audit allows."""
    return bool(self.tools.name) and self.orchestrator.turn_version == "newest"

  @property
  def snapshot_transport(self) -> str:
    """``snapshots.transport`` resolved: ``device`` only for embedded servers in one process."""
    t = self.snapshots.transport
    embedded = self.role == "all" and not self.rollout.remote and not self.distributed.enabled
    if t == "auto":
      return "device" if embedded else "orbax"
    return t

  @property
  def snapshot_write_dtype(self) -> str | None:
    """``snapshots.write_dtype`` resolved: the dtype versions are written and served in
    (``None``: as the learner holds them)."""
    w = self.snapshots.write_dtype
    if w == "master":
      return None
    dtype = w or self.rollout.param_dtype or self.model.param_dtype
    return None if dtype == self.model.param_dtype else dtype

  def __post_init__(self):
    choice(self.BLOCK, "mode", self.mode, tuple(MODES))
    choice(self.BLOCK, "role", self.role, ROLES)
    if self.log_every < 0:
      self.fail("log_every", "must be >= 0")
    if self.snapshots.transport == "device" and (
        self.role != "all" or self.rollout.remote or self.distributed.enabled):
      self.fail("role", "snapshots.transport=device hands versions to servers in the learner's"
                " process: remote servers (rollout.server_addresses, role=learner) and"
                " multi-process runs need snapshots.transport=orbax (or auto)")
    if self.snapshots.transport == "transfer_server" and self.role != "rollout" and (
        not self.rollout.remote or self.distributed.enabled):
      self.fail("role", "snapshots.transport=transfer_server sends versions to remote servers"
                " (rollout.server_addresses) from a single-process learner; embedded servers use"
                " device, multi-process learners orbax")
    if self.total_steps < 0 or self.max_wall_time_s < 0:
      self.fail("total_steps", "total_steps and max_wall_time_s must be >= 0")
