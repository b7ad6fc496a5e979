"""``config.checkpoint`` (run checkpoints) and ``config.snapshots`` (policy versions)."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, choice, field
from jax_dora.config.model import check_dtype

SNAPSHOT_TRANSPORTS = ("auto", "orbax", "device", "transfer_server")


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
  transport: str = field(
      "auto", "How a version reaches the rollout servers: orbax (files in directory, the"
      " durable path and the only one across processes), device (embedded servers: a"
      " device-to-device copy from the learner's devices, no files; Orbax still gets every"
      " durable_every-th version), transfer_server (remote servers pull each version from the"
      " learner's JAX transfer server, jax.experimental.transfer; Orbax as for device), auto ="
      " device for embedded servers in one process, else orbax.")
  durable_every: int = field(
      1, "With transport=device: every this many versions are also written to Orbax by a"
      " background thread (recovery, the audits, time_to_reward); the first always is; a write"
      " still running when the next is due is followed by the newest only (counted). 0 = only"
      " the first.")
  write_dtype: str = field(
      "", "Dtype of the parameters written and served: \"\" = what the servers hold"
      " (rollout.param_dtype, else model.param_dtype), e.g. bfloat16 instead of float32 master"
      " weights (half the bytes); master = model.param_dtype.")
  compress: bool = field(
      False, "zstd-compress snapshot files (Orbax's default): ~22% fewer bytes for bfloat16"
      " weights at ~1.7x the write time on CPU (measured, DESIGN \"Snapshots\"); worth it"
      " only where storage bandwidth, not CPU, bounds the write. Readers decode either.")
  transfer_host: str = field(
      "127.0.0.1", "With transport=transfer_server: the address the learner's and each server's"
      " transfer servers bind and advertise; must be reachable across hosts (the host's IP).")
  memory_versions: int = field(
      2, "With transport=device or transfer_server: newest versions kept in memory on the"
      " learner's devices (one parameter copy each, in write_dtype: accelerator memory); servers"
      " load a version as soon as it is published, older ones come from the durable files.")

  def __post_init__(self):
    if self.max_to_keep < 0:
      self.fail("max_to_keep", "must be >= 1, or 0 to keep every version")
    if self.verify_every < 0:
      self.fail("verify_every", "must be >= 0")
    choice(self.BLOCK, "transport", self.transport, SNAPSHOT_TRANSPORTS)
    if self.durable_every < 0:
      self.fail("durable_every", "must be >= 0")
    if self.memory_versions < 1:
      self.fail("memory_versions", "must be >= 1")
    if self.write_dtype not in ("", "master"):
      check_dtype(self.BLOCK, "write_dtype", self.write_dtype)
