"""Builds a run from a config: devices, learner, snapshots, rollout servers.

This is the one place that knows how the pieces fit together, so that the
CLI (``jax_dora.train``), the benchmarks and the Colab notebook all start the
same system. Embedded rollout servers (in-process, on devices disjoint from
the learner's) are the default; ``rollout.server_addresses`` switches to
remote gRPC servers without changing anything else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from etils import epath

from jax_dora.config import ConfigError, RunConfig, validate
from jax_dora.data import PromptStream, load_file_splits, make_eval_prompts, uses_files
from jax_dora.distributed import maybe_initialize_distributed
from jax_dora.learner.batch_dump import BatchRecorder
from jax_dora.learner.batching import parse_buckets
from jax_dora.learner.mesh import BATCH_AXES, make_mesh, split_devices
from jax_dora.learner.multihost import (
  LeaderLearner,
  LeaderPublisher,
  LearnerGroup,
  follow,
  leader_checkpoint,
  stop_followers,
)
from jax_dora.learner.train_state import Learner
from jax_dora.metrics.writers import WandbSink, open_run_metrics, tensorboard_dir
from jax_dora.orchestrator.dispatch import Dispatcher
from jax_dora.orchestrator.integrity import IntegrityLedger
from jax_dora.orchestrator.modes import mode_class
from jax_dora.orchestrator.run_checkpoint import (
  RunCheckpointer,
  prompt_from_json,
  prompt_to_json,
)
from jax_dora.orchestrator.runner import Orchestrator, PromptSupply, RunHooks
from jax_dora.audit.labels import build_label_audit, chunk_rows, label_max_rows
from jax_dora.audit.sample import SAMPLE_FILE, AuditSample
from jax_dora.audit.snapshots import SnapshotAudit
from jax_dora.policy import PolicySpec, resolve_policy
from jax_dora.rewards import RewardScorer
from jax_dora.snapshots import SnapshotPublisher, SnapshotReader
from jax_dora.snapshots.memory import MemorySnapshots, TieredReader, TransportPublisher
from jax_dora.types import Prompt

log = logging.getLogger("jax_dora")


# Set by the command line (configure_logging); library users (tests, the
# notebook) get INFO logs.
_LOG_LEVEL = logging.INFO


def configure_logging(verbosity: int | None, *, progress_bar: bool) -> None:
  """The command line's log levels from absl's ``--verbosity`` (None: not given).

  Not given: a terminal shows the progress bar, warnings and the end-of-run
  summary, nothing else; a log file or a captured stderr (nohup, a pod's
  logs, a test) gets the INFO lines too, since no bar is read there and a
  record every ``log_every`` steps is. ``-1``: warnings only. ``0``: INFO
  (start-up and per-step lines). ``1`` or more: DEBUG.
  """
  global _LOG_LEVEL
  if verbosity is None:
    bar_on_terminal = progress_bar and sys.stderr.isatty()
    _LOG_LEVEL = logging.WARNING if bar_on_terminal else logging.INFO
  else:
    _LOG_LEVEL = (logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0
                  else logging.DEBUG)
  setup_logging()


def _tell_the_screen(message: str) -> None:
  """A start-up line a quiet terminal shows too (INFO lines are hidden there).

  Compiling every shape takes about a minute on a CPU before the progress bar
  appears; a blank screen for that long reads as a hang.
  """
  if log.isEnabledFor(logging.INFO):
    log.info("%s", message)
  elif sys.stderr.isatty():
    print(message, file=sys.stderr, flush=True)


def setup_logging(level: int | None = None) -> None:
  """Readable one-line logs; quiets the chatty libraries we depend on."""
  level = _LOG_LEVEL if level is None else level
  root = logging.getLogger()
  try:  # absl.app installs its own root handler; keep one readable format.
    from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top

    root.removeHandler(absl_logging.get_absl_handler())
  except ImportError:
    pass
  if not any(getattr(h, "_jax_dora", False) for h in root.handlers):
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", "%H:%M:%S"))
    h._jax_dora = True  # pylint: disable=protected-access
    root.addHandler(h)
  root.setLevel(logging.WARNING)
  logging.getLogger("jax_dora").setLevel(level)
  for noisy in ("absl", "orbax", "jax", "grain"):
    logging.getLogger(noisy).setLevel(logging.WARNING)


def learner_processes(cfg: RunConfig) -> set[int] | None:
  """The processes of the jax.distributed cluster that run the learner.

  ``None`` when the learner is the whole runtime (single process, or
  ``distributed.num_learner_processes == -1``: a learner slice with its own
  cluster). Otherwise processes ``0..n-1``; the rest are rollout servers
  sharing the cluster, whose devices no learner jit may touch and which never
  join the learner's Orbax barriers.
  """
  n = cfg.distributed.num_learner_processes
  if not cfg.distributed.enabled or jax.process_count() == 1 or n < 0:
    return None
  if n >= jax.process_count():
    raise ConfigError(
        f"distributed.num_learner_processes={n} leaves no rollout process in a"
        f" cluster of {jax.process_count()}; use -1 if every process is a learner"
    )
  if jax.process_index() >= n:
    raise ConfigError(
        f"process {jax.process_index()} runs the learner but distributed.num_learner_processes={n}"
        " makes it a rollout process"
    )
  return set(range(n))


def learner_candidate_devices(procs: set[int] | None) -> list[jax.Device]:
  """Devices the learner (and embedded rollout) may use: those of ``procs``."""
  if procs is None:
    return list(jax.devices())
  return [d for d in jax.devices() if d.process_index in procs]


@dataclasses.dataclass
class RunPaths:
  output_dir: epath.Path
  snapshots: epath.Path
  checkpoints: epath.Path
  metrics: epath.Path
  trained_log: epath.Path
  summary: epath.Path
  # What ``python -m jax_dora.export`` needs to rebuild the policy later.
  run_config: epath.Path
  model_config: epath.Path

  @classmethod
  def from_config(cls, cfg: RunConfig) -> RunPaths:
    out = epath.Path(cfg.output_dir)
    snaps = epath.Path(cfg.snapshots.directory) if cfg.snapshots.directory else out / "snapshots"
    return cls(out, snaps, out / "checkpoints", out / "metrics.jsonl",
               out / "trained_samples.jsonl", out / "summary.json", out / "config.json",
               out / "model_config.json")


def new_incarnation() -> str:
  """A fresh id for this start of a run (fresh or resumed); see jax_dora.snapshots."""
  return uuid.uuid4().hex[:12]


def write_run_metadata(paths: RunPaths, cfg: RunConfig, policy: PolicySpec) -> None:
  """The run config and resolved model config, beside the checkpoints that need them."""
  paths.run_config.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
  paths.model_config.write_text(json.dumps(
      {"model": policy.model_cfg.to_dict(), "hf_path": policy.hf_path}, indent=2, sort_keys=True))


def build_rollout_clients(cfg, snapshot_dir: epath.Path | Any, devices: list[jax.Device],
                          policy: PolicySpec | None = None, offers: Any = None):
  """Remote clients, or embedded servers reading versions from ``snapshot_dir`` (a directory
  or a reader, e.g. the in-memory transport's)."""
  if cfg.rollout.server_addresses:
    from jax_dora.rollout.client import connect_all  # pylint: disable=g-import-not-at-top

    # Servers still starting (or down) need no wait here: the dispatcher
    # admits each one once it answers its health check and has loaded the
    # current version; requests wait for an admitted server meanwhile.
    return connect_all(cfg.rollout.server_addresses, timeout_s=cfg.rollout.control_timeout_s,
                       load_timeout_s=cfg.rollout.load_timeout_s, offers=offers,
                       tensor_parallel=cfg.rollout.tensor_parallel,
                       resume_deltas=cfg.rollout.resume_deltas)
  from jax_dora.rollout.embedded import build_embedded_servers  # pylint: disable=g-import-not-at-top

  return build_embedded_servers(cfg, snapshot_dir, devices, policy)


def build_tool_executor(cfg: RunConfig) -> Any:
  """The tool executor of a multi-turn run (``config.tools``), or None.

  The python tool gets the per-call limits of the config and must not read
  the run's output directory (snapshots, checkpoints, logs).
  """
  if not cfg.tools.enabled:
    return None
  from jax_dora.tools import Limits, ToolExecutor  # pylint: disable=g-import-not-at-top

  t = cfg.tools
  limits = Limits(wall_s=t.timeout_s, cpu_s=max(1, int(t.timeout_s + 0.999)),
                  memory_bytes=t.memory_mb << 20)
  return ToolExecutor([t.name], max_concurrency=t.max_concurrency,
                      extra_latency_s=t.extra_latency_s,
                      latency_tail_alpha=t.latency_tail_alpha, seed=cfg.seed,
                      options={"python": {"limits": limits,
                                          "protected": (os.path.abspath(cfg.output_dir),)}})


@dataclasses.dataclass
class RolloutSide:
  """The rollout servers' clients, the dispatcher over them and the reward scorer.

  Training and ``jax_dora.evaluate`` build it the same way
  (:func:`build_rollout_side`), so both judge server health, route requests
  and score completions with one set of settings.
  """

  clients: list[Any]
  dispatcher: Dispatcher
  scorer: RewardScorer
  tools: Any = None  # jax_dora.tools.ToolExecutor of a multi-turn run

  async def close(self) -> None:
    await self.dispatcher.close()  # health monitors first, then the clients they probe
    await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
    self.scorer.close()
    if self.tools is not None:
      self.tools.close()


def build_rollout_side(cfg: RunConfig, snapshot_dir: epath.Path,
                       devices: list[jax.Device], policy: PolicySpec, *,
                       incarnation: str | None = None,
                       on_reissue: Callable[[int, int, str], None] | None = None,
                       offers: Any = None) -> RolloutSide:
  """Rollout clients (embedded or remote), their dispatcher and the scorer, from ``cfg``;
  ``offers``: the learner's transfer offers for remote servers (transfer_server transport)."""
  clients = list(build_rollout_clients(cfg, snapshot_dir, devices, policy, offers=offers))
  dispatcher = Dispatcher(
      clients,
      on_reissue=on_reissue,
      max_restarts=cfg.orchestrator.max_server_restarts,
      health_interval_s=cfg.rollout.health_interval_s,
      health_timeout_s=cfg.rollout.control_timeout_s,
      unhealthy_after_s=cfg.rollout.unhealthy_after_s,
      stall_timeout_s=cfg.rollout.stall_timeout_s,
      no_server_grace_s=cfg.orchestrator.no_server_grace_s,
      seed=cfg.seed,
      incarnation=incarnation,
  )
  return RolloutSide(clients, dispatcher, RewardScorer.from_config(cfg.reward),
                     build_tool_executor(cfg))


def run_async(main: Callable[[], Any]) -> Any:
  """``asyncio.run(main())``, also from inside a running loop (Jupyter/Colab).

  Notebook kernels already run an event loop, where ``asyncio.run`` refuses
  to start; there the orchestrator gets its own loop on a worker thread.
  """
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(main())
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jax_dora_loop") as ex:
    return ex.submit(lambda: asyncio.run(main())).result()


def run_training(
    cfg: ml_collections.ConfigDict,
    after_step: Callable[[dict[str, Any], Orchestrator], Any] | None = None,
) -> dict[str, Any]:
  """Runs a full training job described by ``cfg``; returns the summary.

  ``after_step(record, orchestrator)`` is called after every learner step.
  Under ``jax.distributed`` with a learner of several processes, the primary
  learner process runs the orchestrator and the others mirror its learner
  operations (``jax_dora.learner.multihost``); they return a short summary.
  """
  run = build_run(cfg)
  return run.train(after_step)


@dataclasses.dataclass
class Run:
  """The parts of one training run, built by :func:`build_run`; :meth:`train` runs it.

  Every process of the learner has the device-side parts (mesh, learner,
  snapshot publisher, run checkpointer). Only the primary learner process
  has the host side (prompts, rollout side, ledger, metrics): the others
  mirror the primary's learner operations (``jax_dora.learner.multihost``).
  """

  cfg: RunConfig
  paths: RunPaths
  policy: PolicySpec
  mesh: jax.sharding.Mesh
  group: LearnerGroup
  learner: Learner
  publisher: SnapshotPublisher | TransportPublisher
  checkpointer: RunCheckpointer
  incarnation: str
  resumed_step: int | None
  resume_meta: dict[str, Any]
  rollout_devices: list[jax.Device]
  learner_processes: set[int] | None
  # What servers and audits read versions through: the snapshot directory, or (the
  # in-memory transport) a TieredReader over the versions in memory and the directory.
  snapshot_source: Any = None
  transfer_offers: Any = None  # snapshots.transport=transfer_server: the learner's offers

  def train(self, after_step: Callable[[dict[str, Any], Orchestrator], Any] | None = None
            ) -> dict[str, Any]:
    """Trains to ``total_steps`` (or the wall-time budget); returns the summary."""
    if not self.group.is_primary:
      ok = follow(self.group, self.learner, self.publisher,
                  lambda step: self.checkpointer.save(step, self.learner.state, {"step": step}))
      self.close()
      return {"steps": self.learner.step, "role": "learner-follower",
              "incarnation": self.incarnation,
              "integrity_violations": [] if ok else ["the primary learner process failed"]}
    failed = True
    try:
      summary = self._orchestrate(after_step)
      failed = False
      return summary
    finally:
      # Whatever happened on the primary, the followers must not be left
      # waiting in a broadcast.
      stop_followers(self.group, failed)
      self.close()

  def close(self) -> None:
    self.publisher.close()
    self.checkpointer.close()

  def _orchestrate(self, after_step) -> dict[str, Any]:
    """The primary learner process: prompts, rollouts, batches, publishes, checkpoints."""
    cfg, paths, resumed_step = self.cfg, self.paths, self.resumed_step
    tokenizer = self.policy.tokenizer
    stream = PromptStream(cfg, tokenizer)
    eval_prompts = (make_eval_prompts(cfg, cfg.eval.num_prompts, tokenizer)
                    if cfg.eval.num_prompts else [])
    if uses_files(cfg):
      splits = load_file_splits(cfg, tokenizer)
      log.info("data: %d train / %d eval records of %s (%s)", len(splits.train), len(splits.eval),
               cfg.data.format,
               "nothing skipped" if not splits.skipped else f"skipped {splits.skipped}")
    pending: list[Prompt] = []
    if resumed_step is not None:
      stream.set_state(self.resume_meta["stream"])
      pending = [prompt_from_json(p) for p in self.resume_meta["pending_prompts"]]
      log.info("resumed from step %d with %d pending prompts", resumed_step, len(pending))
    ledger = IntegrityLedger(
        paths.trained_log,
        group_size=cfg.learner.group_size,
        max_staleness=cfg.orchestrator.max_staleness,
        allow_multi_version=mode_class(cfg.mode).resumes_rollouts,
        allow_turn_hops=cfg.turn_hops,
        truncate_after_step=resumed_step if resumed_step is not None else 0,
        incarnation=self.incarnation,
    )
    metrics = open_run_metrics(cfg, paths.metrics, resumed_step=resumed_step,
                               incarnation=self.incarnation)
    learner, checkpointer = self.learner, self.checkpointer
    audit_sample = AuditSample(cfg.audit.verify_fraction, seed=cfg.seed,
                               path=paths.output_dir / SAMPLE_FILE,
                               resumed_from_step=resumed_step or 0)
    source = self.snapshot_source or paths.snapshots
    label_audit = build_label_audit(cfg, source, learner, tokenizer,
                                    enabled=not self.group.multi_process)

    def checkpoint(step: int, pending_prompts: list[Prompt], stream_state: dict[str, Any]) -> None:
      # On an object store the logs upload in batches: make them durable first,
      # so a resume from this checkpoint finds every step it carries over.
      ledger.flush()
      metrics.flush()
      audit_sample.flush()
      checkpointer.save(step, learner.state, {
          "step": step,
          "stream": stream_state,
          "pending_prompts": [prompt_to_json(p) for p in pending_prompts],
      })

    trainer: Any = learner
    publisher: Any = self.publisher
    if self.group.multi_process:
      trainer = LeaderLearner(learner, self.group)
      publisher = LeaderPublisher(publisher, self.group)
      checkpoint = leader_checkpoint(checkpoint, self.group)
    if cfg.learner.dump_batches_dir:
      trainer = BatchRecorder(trainer, cfg.learner.dump_batches_dir)

    rollout = build_rollout_side(cfg, source, self.rollout_devices, self.policy,
                                 offers=self.transfer_offers,
                                 incarnation=self.incarnation, on_reissue=ledger.reissued)
    progress = None
    if cfg.progress_bar:
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

      progress = tqdm(total=cfg.total_steps, initial=learner.step, desc=cfg.mode,
                      dynamic_ncols=True, unit="step")
    try:
      with metrics:
        orch = Orchestrator(
            cfg,
            learner=trainer,
            publisher=publisher,
            dispatcher=rollout.dispatcher,
            prompts=PromptSupply(stream, pending=pending, eval=eval_prompts),
            tokenizer=tokenizer,
            scorer=rollout.scorer,
            ledger=ledger,
            hooks=RunHooks(metrics, checkpoint_fn=checkpoint, progress=progress,
                           after_step=after_step, samples=metrics.write_samples),
            incarnation=self.incarnation,
            tool_executor=rollout.tools,
            snapshot_audit=SnapshotAudit(source, cfg.snapshots.verify_every,
                                         cast=cfg.snapshot_write_dtype),
            audit_sample=audit_sample,
            label_audit=label_audit,
        )

        async def main():
          try:
            return await orch.run()
          finally:
            await rollout.close()

        summary = run_async(main)
    finally:
      if progress is not None:
        progress.close()
      ledger.close()
    summary["output_dir"] = str(paths.output_dir)
    summary["metrics_path"] = str(paths.metrics)
    if cfg.metrics.tensorboard:
      summary["tensorboard_dir"] = tensorboard_dir(str(paths.output_dir))
    wandb_dirs = [s.dir for s in metrics.sinks if isinstance(s, WandbSink)]
    if wandb_dirs:
      summary["wandb_dir"] = wandb_dirs[0]
    summary["incarnation"] = self.incarnation
    summary["samples_drawn"] = stream.next_sample_id
    summary["reward_failures"] = rollout.scorer.metrics()
    if uses_files(cfg):
      summary["data_rows_skipped"] = load_file_splits(cfg, tokenizer).skipped
    paths.summary.write_text(json.dumps(summary, indent=2, default=str))
    log.info("done: %s", json.dumps(summary, default=str))
    if summary["integrity_violations"]:
      log.error("integrity violations: %s", summary["integrity_violations"])
    return summary


def check_run_config(cfg: ml_collections.ConfigDict | RunConfig) -> RunConfig:
  """:func:`validate` plus what only a training run refuses; the typed config."""
  cfg = validate(cfg)
  if cfg.eval.greedy:
    raise ConfigError("config.eval.greedy is for `python -m jax_dora.evaluate --greedy`, which starts"
                      " its own servers: the in-training eval shares the rollout servers, whose"
                      " sampling temperature is rollout.temperature")
  if cfg.role == "rollout":
    raise ConfigError("config.role=rollout is a rollout server: start it with"
                      " `python -m jax_dora.rollout.server_main`, not jax_dora.train")
  return cfg


def _durable_phrase(every: int) -> str:
  """``snapshots.durable_every`` in words for the start-up log ("every version", "every 4th")."""
  if every <= 0:
    return "the first version only"
  if every == 1:
    return "every version"
  suffix = "th" if 10 <= every % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(every % 10, "th")
  return f"every {every}{suffix} version"


def build_run(cfg: ml_collections.ConfigDict | RunConfig) -> Run:
  """Builds every part of a training run from ``cfg`` (nothing trains yet).

  Devices are split between learner and rollout, the learner is built (from
  the HF checkpoint, a run checkpoint or random init) and compiled
  (``precompile``), and version ``learner.step`` is published so the
  rollout servers have a policy to load. The host side (prompts, servers,
  dispatcher, ledger, metrics) is built by :meth:`Run.train` on the primary.
  """
  cfg = check_run_config(cfg)  # typed from here on
  setup_logging()
  maybe_initialize_distributed(cfg)
  paths = RunPaths.from_config(cfg)
  policy = resolve_policy(cfg)
  remote = cfg.role == "learner"  # validate(): role=learner <=> server addresses
  n_rollout = 0 if remote else cfg.rollout.num_servers * cfg.rollout.devices_per_server
  procs = learner_processes(cfg)
  learner_devs, rollout_devs = split_devices(
      cfg.learner.num_devices, n_rollout, learner_candidate_devices(procs))
  group = LearnerGroup(learner_devs)
  if group.multi_process and not remote:
    raise ConfigError(
        f"the learner spans processes {group.processes}: rollout servers must be remote"
        " (config.role=learner with config.rollout.server_addresses); only the primary"
        " learner process runs the orchestrator")
  if not remote and set(learner_devs) & set(rollout_devs):
    log.warning("only one device: learner and rollout share it")
  mesh = make_mesh(learner_devs, cfg.learner.mesh_data, cfg.learner.mesh_fsdp,
                   cfg.learner.mesh_tensor, cfg.learner.mesh_expert)
  batch_shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
  batch_rows = cfg.learner.batch_rows
  if batch_rows % batch_shards:
    raise ConfigError(
        f"learner batch of {batch_rows} trajectories (groups_per_step x group_size) is not"
        f" divisible by the {batch_shards} data x fsdp x expert shards of the learner mesh"
        f" {dict(mesh.shape)}"
    )
  if group.is_primary:
    paths.output_dir.mkdir(parents=True, exist_ok=True)
    write_run_metadata(paths, cfg, policy)
  log.info("mode=%s learner mesh %s on %d devices of %d process(es); %s rollout", cfg.mode,
           dict(mesh.shape), len(learner_devs), group.size,
           "remote" if remote else f"{len(rollout_devs)} embedded device(s)")

  checkpointer = RunCheckpointer(paths.checkpoints, cfg.checkpoint.max_to_keep, processes=procs)
  resumed_step = checkpointer.latest_step() if cfg.checkpoint.resume else None
  if not cfg.checkpoint.resume:
    checkpointer.discard_after(0)  # a fresh run starts the directory over

  # An HF checkpoint is read straight onto the learner's shardings, unless a
  # run checkpoint is about to replace the weights anyway.
  load = policy.load_params if policy.checkpoint is not None and resumed_step is None else None
  t0 = time.time()
  learner = Learner(
      policy.model_cfg, cfg.learner, mesh,
      temperature=cfg.rollout.temperature, seed=cfg.seed,
      suppress_mask=policy.suppress_mask, load_params=load,
  )
  if load is not None:
    log.info("loaded %s onto the learner mesh in %.1fs", policy.hf_path, time.time() - t0)
  if cfg.precompile:
    _tell_the_screen("compiling the learner step and the rollout servers' decode before the clock"
                     " starts (config.precompile) ...")
    t0 = time.time()
    learner.warmup(batch_rows, parse_buckets(cfg.learner.seq_len_buckets, cfg.model.max_seq_len))
    if cfg.audit.verify_fraction > 0 and not group.multi_process:  # the audit's label check
      learner.compile_logprobs(chunk_rows(learner.batch_devices, label_max_rows(cfg)),
                               learner.seq_len_buckets)
    log.info("compiled the train step for every length bucket in %.1fs", time.time() - t0)
  meta: dict[str, Any] = {}
  if resumed_step is not None:
    learner.state, meta = checkpointer.restore(resumed_step, learner.state)

  incarnation = group.broadcast_text(new_incarnation())
  # Servers holding a cast copy (rollout.param_dtype) verify it against the
  # checksums of the cast tree, which the publisher records too.
  casts = ((cfg.rollout.param_dtype,)
           if cfg.rollout.param_dtype and cfg.rollout.param_dtype != cfg.model.param_dtype else ())
  publisher: Any = SnapshotPublisher(
      paths.snapshots, max_to_keep=cfg.snapshots.max_to_keep or None, processes=procs,
      incarnation=incarnation, checksum_casts=casts, write_dtype=cfg.snapshot_write_dtype,
      compress=cfg.snapshots.compress)
  source: Any = None
  offers = None
  if cfg.snapshot_transport in ("device", "transfer_server"):
    memory = MemorySnapshots(cfg.snapshots.memory_versions)
    serve_layout = None
    if cfg.snapshot_transport == "transfer_server":
      from jax_dora.snapshots.transfer import TransferOffers  # pylint: disable=g-import-not-at-top

      offers = TransferOffers(memory, policy.model_cfg, list(mesh.devices.flat),
                              cfg.snapshots.transfer_host)
      # Each version is staged in the servers' layout once, at publish, and kept that way:
      # every server's offer is then the kept copy itself (snapshots/transfer.py).
      tp = cfg.rollout.tensor_parallel
      serve_layout = functools.partial(offers.stage, tensor_parallel=tp)
    publisher = TransportPublisher(publisher, memory, cfg.snapshots.durable_every,
                                   serve_layout=serve_layout)
    source = TieredReader(memory, SnapshotReader(paths.snapshots))
    log.info("policy versions reach the servers in memory (snapshots.transport=%s%s); Orbax"
             " gets %s", cfg.snapshot_transport, f", offered at {offers.address}" if offers else "",
             _durable_phrase(cfg.snapshots.durable_every))
  version = learner.step
  # Every version from the start one on is republished by this incarnation:
  # the directory may hold a killed run's later versions, or another run's
  # (a fresh run reusing it), under the same numbers.
  publisher.discard_after(version - 1)
  publisher.publish(version, learner.params, {"step": version})
  log.info("run incarnation %s starts at policy version %d", incarnation, version)
  return Run(cfg=cfg, paths=paths, policy=policy, mesh=mesh, group=group, learner=learner,
             publisher=publisher, checkpointer=checkpointer, incarnation=incarnation,
             resumed_step=resumed_step, resume_meta=meta, rollout_devices=rollout_devs,
             learner_processes=procs, snapshot_source=source, transfer_offers=offers)


def cpu_friendly_env() -> None:
  """Forces enough host devices for disjoint learner/rollout meshes on CPU."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags and not os.environ.get("JAX_PLATFORMS", "").startswith(("tpu", "cuda", "gpu")):
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
