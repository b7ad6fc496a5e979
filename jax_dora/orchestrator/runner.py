"""The host-side asyncio orchestrator: what every training mode shares.

A run has one prompt supply, a :class:`Dispatcher` over rollout servers, the
trajectory pool, the learner and the snapshot publisher. The modes
(:mod:`jax_dora.orchestrator.modes`) differ only in *when* they generate and
*which* policy version a request may use; this class gives them the shared
steps: draw a prompt, roll out a group, wait for a batch of complete groups,
train on it and publish the new version, record and checkpoint the step.

The three DORA constraints are enforced here and audited by the
:class:`IntegrityLedger`: intra-trajectory consistency (requests are never
interrupted in ``dora``/``dora_pace``/``sync``/``one_step_off``), data integrity
(every issued sample is trained once, rejected with a logged reason and
regenerated, or carried to the next run as pending), bounded staleness (the
pool evicts groups older than ``max_staleness``, the producer never has more
samples outstanding than can be consumed within the bound, and the learner
refuses anything staler, newer than itself, or of another run incarnation).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from jax_dora.learner.batching import bucket_length, make_batch, parse_buckets
from jax_dora.learner.losses import compute_advantages
from jax_dora.metrics.histogram import staleness_histogram
from jax_dora.orchestrator import dynamic_sampling
from jax_dora.rewards.overlong import overlong_penalty
from jax_dora.orchestrator import staleness as staleness_lib
from jax_dora.orchestrator.dispatch import Dispatcher
from jax_dora.audit.labels import LabelAudit
from jax_dora.audit.rewards import RewardAudit
from jax_dora.audit.sample import AuditSample
from jax_dora.audit.snapshots import SnapshotAudit
from jax_dora.orchestrator.evaluation import Evaluator, length_budget
from jax_dora.orchestrator.integrity import IntegrityLedger
from jax_dora.orchestrator.modes import Mode, mode_class
from jax_dora.config.run import RunConfig
from jax_dora.orchestrator.host import PublisherLike, ScorerLike, TrainerLike
from jax_dora.orchestrator.pace import PaceController
from jax_dora.orchestrator.pool import TrajectoryPool
from jax_dora.orchestrator.publishing import BackgroundPublisher
from jax_dora.orchestrator.collector import STALE_TURN, TrajectoryCollector
from jax_dora.orchestrator.multiturn import ToolLoop, recheck_tool_calls
from jax_dora.orchestrator.telemetry import RolloutTelemetry, log_line
from jax_dora.types import Prompt, Trajectory

log = logging.getLogger(__name__)

# Tool calls of the trained samples the end-of-run audit runs again.
TOOL_AUDIT_SAMPLE = 16


@dataclasses.dataclass
class RunHooks:
  """Where a run reports to: metrics, checkpoints, progress bar, callbacks."""

  metrics: Any  # ``.write(record)``
  # ``checkpoint_fn(step, pending_prompts, stream_state)``
  checkpoint_fn: Callable[[int, list[Prompt], dict[str, Any]], None] | None = None
  progress: Any = None  # a tqdm bar
  # Called after every learner step with the step's metrics record (may be
  # async): the extension point for callbacks, fault injection in tests, etc.
  after_step: Callable[[dict[str, Any], "Orchestrator"], Any] | None = None
  # ``samples(step, [{"sample", "prompt", "completion", "reward"}, ...])``: a
  # few decoded trained completions every ``metrics.text_every_steps`` steps
  # (the dashboards' text view).
  samples: Callable[[int, list[dict[str, Any]]], None] | None = None


@dataclasses.dataclass
class PromptSupply:
  """Training prompts (a checkpointable stream), carried-over ones, held-out ones."""

  source: Any  # ``next_prompt()``, ``get_state()`` (``jax_dora.data.PromptStream``)
  pending: Sequence[Prompt] = ()  # issued by a killed run and never trained
  eval: Sequence[Prompt] = ()


class Orchestrator:
  """Drives one training run in the configured mode."""

  def __init__(
      self,
      cfg: RunConfig | Any,
      *,
      learner: TrainerLike,
      publisher: PublisherLike,
      dispatcher: Dispatcher,
      prompts: PromptSupply,
      tokenizer: Any,
      scorer: ScorerLike,
      ledger: IntegrityLedger,
      hooks: RunHooks,
      incarnation: str = "",
      tool_executor: Any = None,
      snapshot_audit: SnapshotAudit | None = None,
      audit_sample: AuditSample | None = None,
      label_audit: LabelAudit | None = None,
  ):
    cfg = RunConfig.of(cfg)  # typed from here on (a ConfigDict is validated block by block)
    self.cfg = cfg
    self.mode = cfg.mode
    self.learner = learner
    self.publisher = publisher
    self.dispatcher = dispatcher
    self.prompt_source = prompts.source
    self.tokenizer = tokenizer
    # Awaitable ``score(prompt, completion_text) -> float``
    # (``jax_dora.rewards.RewardScorer``): verifiers may run in worker processes.
    self.scorer = scorer
    self.ledger = ledger
    self.hooks = hooks
    # Multi-turn (tools.name): the calls go to ``tool_executor``
    # (jax_dora.tools.ToolExecutor); None = single-turn.
    self.tool_executor = tool_executor
    # Published versions checked against the learner's own parameters
    # (jax_dora.audit.snapshots); None = not checked.
    self.snapshot_audit = snapshot_audit
    # The audit's sample (audit.verify_fraction of the trained trajectories): rewards
    # re-scored at the end, version labels recomputed between steps (jax_dora.audit).
    self.audit_sample = audit_sample or AuditSample(cfg.audit.verify_fraction, seed=cfg.seed)
    self.reward_audit = RewardAudit()
    # None: labels not recomputed (run_training builds one on the learner's devices).
    self.label_audit = label_audit
    self._audit_s = 0.0  # learner time the last step spent checking labels
    self._audit_total_s = 0.0  # ... and the whole run so far
    self.tool_audit: dict[str, int] = {}
    # What the end-of-run audit re-verified, by kind (summary["audit"]).
    self.audit_counts: dict[str, int] = {}
    self.tool_loop = ToolLoop.from_config(cfg.tools, tool_executor, tokenizer)
    if self.tool_loop is not None and tool_executor is None:
      raise ValueError("config.tools.name is set but no tool executor was given")
    # This run's incarnation (jax_dora.snapshots): a trajectory generated by
    # another incarnation's versions is never trained.
    self.incarnation = incarnation
    # Every training trajectory's turn loop (the held-out eval runs the same one).
    self.collector = TrajectoryCollector(
        dispatcher, self.tool_loop, check=lambda r: self._foreign(r.incarnation, r.spans),
        on_restart=self._restarted, learner_version=lambda: self.version,
        stale_after=(cfg.orchestrator.max_staleness if cfg.orchestrator.restart_stale_turns
                     else None))

    self.group_size = cfg.learner.group_size
    self.groups_per_step = cfg.learner.groups_per_step
    self.max_staleness = cfg.orchestrator.max_staleness
    self.max_new_tokens = cfg.rollout.max_new_tokens
    self.fixed_lengths = cfg.rollout.length_mode == "answer"
    self.version = int(learner.step)  # newest policy version the learner produced
    self.pool = TrajectoryPool(self.group_size, self.max_staleness)
    self._seq_buckets = parse_buckets(cfg.learner.seq_len_buckets, cfg.model.max_seq_len)
    # The mode strategy: owns the loop, its producer and gates; the rest of
    # this class asks it what the mode does instead of comparing names.
    self.strategy: Mode = mode_class(cfg.mode)(
        self, queue_depth=cfg.orchestrator.queue_depth,
        fill_staleness_budget=cfg.orchestrator.fill_staleness_budget)
    self.pace = PaceController(cfg.pace) if self.strategy.uses_pace else None
    self.pace_rejected = 0
    self.zero_variance = dynamic_sampling.ZeroVarianceFilter(
        cfg.learner.dynamic_sampling, self.groups_per_step, cfg.learner.dynamic_sampling_max_draws)
    self._judged: set[int] = set()  # complete pooled groups the filter has seen
    # Prompts to (re)generate before drawing new ones: carried over from a
    # resumed run, or rejected by PACE / evicted as stale.
    self._regenerate: collections.deque[Prompt] = collections.deque(prompts.pending)
    # Prompts issued and not yet trained, by sample id (for checkpoints).
    self._outstanding: dict[int, Prompt] = {}
    self._pool_changed = asyncio.Event()
    self.stopping = False
    self._fatal: BaseException | None = None
    self._bg_tasks: set[asyncio.Task] = set()
    self._t0 = time.time()
    self._trained_tokens = 0
    self._trained_groups = 0
    self._generated_tokens = 0
    # Completion tokens of groups that left without training (stale, PACE,
    # zero variance): rollout work the learner never used.
    self._wasted_tokens = 0
    self._last_trained: list[Trajectory] = []
    self._telemetry = RolloutTelemetry()
    self.evaluator = Evaluator(prompts.eval, dispatcher, scorer, tokenizer, self.length_budget,
                               num_samples=cfg.eval.num_samples,
                               correct_threshold=cfg.eval.correct_threshold,
                               tool_loop=self.tool_loop)
    self.publish_in_background = (
        cfg.orchestrator.async_publish and self.strategy.publishes_in_background
    )
    self._background = BackgroundPublisher(
        publisher, self.version, self.on_published, self.spawn, self.fail)

  @property
  def published_version(self) -> int:
    """Newest version written to the snapshot directory (lags ``version`` in background)."""
    return self._background.published_version if self.publish_in_background else self.version

  # ------------------------------------------------------------------ prompts
  def next_prompt(self) -> Prompt:
    p = self._regenerate.popleft() if self._regenerate else self.prompt_source.next_prompt()
    self._outstanding[p.sample_id] = p
    return p

  def _prompt_tokens(self, p: Prompt) -> np.ndarray:
    # BOS / chat template as the tokenizer defines them for prompts.
    return np.asarray(self.tokenizer.encode_prompt(p.text), np.int32)

  def length_budget(self, p: Prompt) -> tuple[int, bool]:
    """``(max_new_tokens, ignore_eos)`` for a request on ``p`` (``rollout.length_mode``)."""
    return length_budget(self.tokenizer, self.max_new_tokens, self.fixed_lengths, p)

  def pending_prompts(self) -> list[Prompt]:
    """Prompts issued but not trained: re-issued by a resumed run."""
    seen = {p.sample_id: p for p in self._regenerate}
    seen.update(self._outstanding)
    return [seen[k] for k in sorted(seen)]

  # ----------------------------------------------------------------- rollouts
  async def rollout_member(
      self, prompt: Prompt, member: int, version: int | None, *, interruptible: bool
  ) -> Trajectory:
    """Generates one trajectory, resuming it after interruptions if allowed.

    Multi-turn (``tools.name``): a turn that ends at a tool call gets the
    tool's observation appended and the trajectory goes on. In a mode that
    never moves a trajectory to another version, each turn's version stays
    held on its server while the tool runs (``RolloutRequest.hold``) and the
    next turn goes to that server, so every token is sampled by the version
    that started the trajectory; if that server is lost meanwhile, no other
    server can continue on the version, so the sample starts over (re-issued,
    in the ledger).
    """
    tokens = self._prompt_tokens(prompt)
    submit = time.time()
    self.ledger.issued(prompt.sample_id, member, self.version)
    budget, ignore_eos = self.length_budget(prompt)
    hold = (f"{self.incarnation}-{prompt.sample_id}-{member}"
            if self.tool_loop is not None and not self.strategy.resumes_rollouts else "")
    traj = await self.collector.collect(
        prompt, tokens, member, budget, version=version, ignore_eos=ignore_eos, hold=hold,
        keep_version=self.cfg.orchestrator.turn_version == "held",
        on_abort="resume" if interruptible else "return",
        before_resume=self.strategy.before_resume, stopping=lambda: self.stopping,
        submit_time=submit)
    if traj.finish_reason == "aborted":
      return traj
    traj.finish_version = self.version
    traj.reward = float(await self.scorer.score(
        prompt, self.tokenizer.decode(traj.completion_tokens.tolist())))
    traj.reward_shaping = overlong_penalty(
        traj.num_completion_tokens, budget, self.cfg.reward.overlong_buffer,
        self.cfg.reward.overlong_penalty)
    traj.reward += traj.reward_shaping
    self._generated_tokens += traj.num_sampled_tokens
    self.ledger.finished(traj)
    return traj

  def _restarted(self, sample_id: int, member: int, why: str) -> None:
    """A sample starts over (its held version's server was lost, or a foreign result)."""
    self.ledger.reissued(sample_id, member, why)
    # A stale turn restart is routine under orchestrator.restart_stale_turns (counted per step).
    (log.debug if why.startswith(STALE_TURN) else log.warning)(
        "restarting %s-%d: %s", sample_id, member, why)

  def _foreign(self, incarnation: str, spans: Sequence[Any]) -> str | None:
    """Why a result cannot come from this run's policy versions (None if it can)."""
    if self.incarnation and incarnation != self.incarnation:
      return f"generated by run incarnation {incarnation!r}, not this run's {self.incarnation!r}"
    newer = [sp.version for sp in spans if sp.version > self.version]
    if newer:
      return f"span from version {max(newer)} newer than learner version {self.version}"
    return None

  async def rollout_group(
      self, prompt: Prompt, version: int | None = None, *, interruptible: bool = False
  ) -> list[Trajectory]:
    return list(await asyncio.gather(*(
        self.rollout_member(prompt, m, version, interruptible=interruptible)
        for m in range(self.group_size))))

  async def generate_batch(self, version: int | None) -> list[list[Trajectory]]:
    """``groups_per_step`` new groups, all on ``version`` (None: newest).

    With dynamic sampling, zero-variance groups are dropped and replaced by
    groups on new prompts (same version) until the batch is full.
    """
    groups: list[list[Trajectory]] = []
    while len(groups) < self.groups_per_step:
      prompts = [self.next_prompt() for _ in range(self.groups_per_step - len(groups))]
      fresh = await asyncio.gather(*(self.rollout_group(p, version) for p in prompts))
      keep, drop = self.zero_variance.split(fresh)
      self._reject(drop, dynamic_sampling.REASON)
      groups.extend(keep)
    return groups

  # --------------------------------------------------------------------- pool
  def add_to_pool(self, t: Trajectory) -> None:
    self.pool.add(t, self.version)
    self._pool_changed.set()

  def _reject(self, groups: list[list[Trajectory]], reason: str | Sequence[str]) -> None:
    """Records rejected/evicted groups; their prompts are regenerated or dropped.

    Stale evictions are always regenerated (the sample was never trained);
    PACE rejections follow ``pace.on_reject``.
    """
    reasons = [reason] * len(groups) if isinstance(reason, str) else list(reason)
    for g, why in zip(groups, reasons):
      self._wasted_tokens += int(sum(t.num_sampled_tokens for t in g))
      # A zero-variance group is replaced by a new prompt, not re-rolled.
      regenerate = why == "stale" or (
          why != dynamic_sampling.REASON and self.cfg.pace.on_reject == "regenerate")
      self.ledger.rejected(g, why, regenerate=regenerate, version=self.version)
      self._outstanding.pop(g[0].sample_id, None)
      if regenerate:
        self._regenerate.append(g[0].prompt)
      else:
        log.info("dropping group %d (%s)", g[0].sample_id, why)
    if groups:
      self.kick_producer()

  async def wait_batch(self) -> list[list[Trajectory]]:
    """The next ``groups_per_step`` complete groups, after evictions and PACE."""
    while True:
      if self._fatal is not None:
        raise self._fatal
      evicted = self.pool.evict_stale(self.version)
      self._reject(evicted, "stale")
      if self.zero_variance.enabled:
        self._drop_zero_variance()
      if self.pace is not None:
        # The oldest groups_per_step complete groups are the next batch: PACE
        # only trims the backlog beyond it.
        rejected = self.pace.select_rejections(
            self.pool, self.version, reserve_groups=self.groups_per_step
        )
        if rejected:
          self.pool.remove([g for g, _, _ in rejected], reason="pace", version=self.version)
          for g, score, why in rejected:
            log.debug("PACE rejects group %d score %.2f (%s)", g[0].sample_id, score, why)
          self._reject([g for g, _, _ in rejected], [why for _, _, why in rejected])
          self.pace_rejected += len(rejected)
      if self.pool.num_complete_groups() >= self.groups_per_step:
        return self.pool.pop_groups(self.groups_per_step)
      self._pool_changed.clear()
      await self._pool_changed.wait()

  def _drop_zero_variance(self) -> None:
    """Dynamic sampling on the pool: judges each newly complete group once."""
    new = [g for g in self.pool.complete_groups() if g[0].sample_id not in self._judged]
    self._judged.update(g[0].sample_id for g in new)
    _, drop = self.zero_variance.split(new)
    if drop:
      self.pool.remove(drop, reason=dynamic_sampling.REASON, version=self.version)
      self._reject(drop, dynamic_sampling.REASON)

  # ------------------------------------------------------------------ learner
  async def train(self, groups: list[list[Trajectory]], *, wait_s: float) -> dict[str, Any]:
    """One learner step on complete groups, then publish the new version.

    ``wait_s``: how long the learner waited for this batch (the bubble).
    """
    trajs = [t for g in groups for t in g]
    for t in trajs:
      # Enforced at consumption, not only audited afterwards.
      why = self._foreign(t.incarnation, t.spans)
      if why is not None:
        raise AssertionError(f"refusing to train {t.key}: {why}")
      t.consumed_version = self.version
      bs = staleness_lib.behaviour_staleness(t, self.version)
      if bs > self.max_staleness:
        raise AssertionError(
            f"staleness bound violated: {t.key} behaviour staleness {bs} > {self.max_staleness}"
        )
    rewards = np.asarray([t.reward for t in trajs], np.float32)
    adv = compute_advantages(
        self.cfg.learner.advantage_estimator, rewards, self.group_size,
        eps=self.cfg.learner.advantage_eps)
    seq_len = bucket_length(trajs, self._seq_buckets)
    batch = make_batch(trajs, adv, seq_len, self.tokenizer.pad_id, learner_version=self.version,
                       mask_truncated=self.cfg.learner.mask_truncated,
                       routing=self.learner.routing)
    self.zero_variance.new_step()
    self._judged.difference_update(g[0].sample_id for g in groups)
    t0 = time.time()
    train_metrics = await asyncio.to_thread(self.learner.train_step, batch)
    train_s = time.time() - t0
    step = self.learner.step
    self.ledger.trained(trajs, learner_version=self.version, step=step)
    picked = self.audit_sample.pick(trajs, step=step, learner_version=self.version)
    self.reward_audit.keep(picked)
    if self.label_audit is not None:
      self.label_audit.keep(picked)
    for g in groups:
      self._outstanding.pop(g[0].sample_id, None)
    self._trained_tokens += int(sum(t.num_sampled_tokens for t in trajs))
    self._trained_groups += len(groups)
    self._last_trained = trajs

    t0 = time.time()
    new_version = self.version + 1
    if self.publish_in_background:
      # Only the copy blocks the learner: the next (donating) train step may
      # start while Orbax writes this one.
      # Copied straight into the publisher's write dtype: the in-memory transport serves
      # this copy as it is and Orbax writes it without another cast (one copy, not two).
      snapshot = await asyncio.to_thread(self.learner.detached_params, new_version,
                                         getattr(self.publisher, "write_dtype", None))
      await self._remember_params(new_version)
      self.version = new_version
      self._background.submit(new_version, snapshot, owned=True)
    else:
      await self._remember_params(new_version)
      await asyncio.to_thread(
          self.publisher.publish, new_version, self.learner.params, {"step": step}
      )
      await self._check_published(new_version)
      self.version = new_version
    publish_s = time.time() - t0
    await self._verify_labels()
    return self._step_record(step, trajs, train_metrics, wait_s, train_s, publish_s)

  async def _verify_labels(self, *, drain: bool = False) -> None:
    """The label audit's share of the learner's time: one claimed version per step
    (every pending one at the end of the run); what it finds goes to the ledger."""
    self._audit_s = 0.0
    audit = self.label_audit
    if audit is None or not audit.active or not audit.pending_versions:
      return
    t0 = time.time()
    if not drain and self._audit_total_s > self.cfg.audit.label_time_share * (t0 - self._t0):
      audit.skip_next()  # over the time budget: the learner trains on
      return
    found = await asyncio.to_thread(audit.verify_all if drain else audit.verify_next)
    self._audit_s = time.time() - t0
    self._audit_total_s += self._audit_s
    for kind, message in found:
      log.error("audit: %s", message)
      self.ledger.audit_failure(kind, message)

  # -------------------------------------------------------------- publishing
  async def _remember_params(self, version: int) -> None:
    """The learner's own checksums of ``version``, if the snapshot audit checks it
    (before the next step can donate the parameters)."""
    if self.snapshot_audit is not None and self.snapshot_audit.wants(version):
      await asyncio.to_thread(self.snapshot_audit.remember, version, self.learner.params)

  async def _check_published(self, version: int) -> None:
    if self.snapshot_audit is None:
      return
    problem = await asyncio.to_thread(self.snapshot_audit.check, version)
    if problem is not None:
      self.ledger.snapshot_mismatch(version, problem)

  async def on_published(self, version: int) -> None:
    """Makes servers load ``version`` once it is written. A background write is
    checked here by the snapshot audit; a synchronous one already was, in ``train``."""
    if self.publish_in_background:
      await self._check_published(version)
    await self.dispatcher.broadcast_version(version)
    if self.strategy.interrupts_on_publish:
      # One version per server: interrupt in-flight rollouts so they resume
      # on the one just loaded (their prefix keeps its old-version span).
      await self.dispatcher.abort_all()
    self.kick_producer()

  # ----------------------------------------------------------- step records
  def _step_record(self, step, trajs, train_metrics, wait_s, train_s, publish_s) -> dict[str, Any]:
    v = self.version - 1  # the version the batch was trained at
    gen = [staleness_lib.generation_staleness(t, t.finish_version) for t in trajs]
    wait = [staleness_lib.waiting_staleness(t, v) for t in trajs]
    eff = [staleness_lib.effective_staleness(t, v) for t in trajs]
    beh = [staleness_lib.behaviour_staleness(t, v) for t in trajs]
    elapsed = time.time() - self._t0
    step_total = wait_s + train_s + publish_s + self._audit_s
    rec = {
        "step": step,
        "version": self.version,
        "mode": self.mode,
        "reward_mean": float(np.mean([t.reward for t in trajs])),
        "completion_len_mean": float(np.mean([t.num_completion_tokens for t in trajs])),
        "completion_len_max": int(max(t.num_completion_tokens for t in trajs)),
        "trained_tokens": int(sum(t.num_sampled_tokens for t in trajs)),
        "trained_tokens_per_s": self._trained_tokens / max(elapsed, 1e-9),
        "generated_tokens_per_s": self._generated_tokens / max(elapsed, 1e-9),
        "learner_wait_s": wait_s,
        "learner_train_s": train_s,
        # Learner-blocking publish time (only the device copy when publishing
        # in the background); the Orbax write itself is publish_background_s.
        "publish_s": publish_s,
        "published_version": self.published_version,
        "publish_background_s": self._background.last_write_s,
        "publish_skipped_total": self._background.skipped,
        # Learner time spent recomputing the audit sample's version labels.
        "audit_s": self._audit_s,
        "step_time_s": step_total,
        # Learner idle share of the step. In sync mode this is exactly the
        # rollout share of step time (the learner waits for the whole batch).
        "bubble_ratio": wait_s / max(step_total, 1e-9),
        "pool_groups": self.pool.occupancy(),
        "staleness_generation": staleness_histogram(gen),
        "staleness_waiting": staleness_histogram(wait),
        "staleness_effective": staleness_histogram(eff),
        "staleness_behaviour": staleness_histogram(beh),
        "multi_version_trajectories": int(sum(len(t.behaviour_versions) > 1 for t in trajs)),
        "wasted_rollout_tokens_total": self._wasted_tokens,
        # Share of the completion tokens generated so far that were thrown away.
        "wasted_rollout_frac": self._wasted_tokens / max(self._generated_tokens, 1),
        "wall_time_s": elapsed,
    }
    rec.update({f"train/{k}": v for k, v in train_metrics.items()})
    rec["truncated_frac"] = float(np.mean([t.finish_reason == "length" for t in trajs]))
    rec["overlong_penalty_mean"] = float(np.mean([t.reward_shaping for t in trajs]))
    # Drops are counted by the ledger that records them.
    rec["dynamic_sampling/dropped_total"] = self.ledger.count(dynamic_sampling.REASON)
    rec["dynamic_sampling/accepted_over_budget"] = self.zero_variance.accepted_over_budget
    # Verifier timeouts / crashes / errors so far (each scored 0).
    rec.update(self.scorer.metrics())
    if self.tool_executor is not None:
      rec.update(self.tool_executor.metrics())
      rec["tools/calls_per_trajectory"] = float(np.mean([len(t.tool_calls) for t in trajs]))
      rec["tools/stale_turn_restarts_total"] = self.collector.stale_restarts
      rec["tools/tool_wait_staleness_mean"] = float(np.mean(
          [staleness_lib.tool_wait_staleness(t) for t in trajs]))
    if self.strategy.streams:
      # Groups that left the pool untrained so far (regenerated or dropped).
      rec["pace_rejected_total"] = self.pace_rejected
      rec["stale_evicted_total"] = self.ledger.count("stale")
      if self.pace is not None:
        rec["pace"] = self.pace.stats()
    return rec

  async def after_learner_step(self, rec: dict[str, Any]) -> None:
    """Telemetry, eval, metrics, callbacks, progress and checkpoint of one step."""
    rec.update(await self._telemetry.sample(self.dispatcher.live_clients))
    rec.update(self.dispatcher.group_affinity_counts())
    step = rec["step"]
    every = self.cfg.eval.every_steps
    if every > 0 and (step % every == 0 or step == self.cfg.total_steps):
      rec["eval_reward"] = await self.evaluator.evaluate()
      rec.update(self.evaluator.last_metrics)
    self.hooks.metrics.write(rec)
    text_every = self.cfg.metrics.text_every_steps
    if (self.hooks.samples is not None and text_every > 0 and self.cfg.metrics.num_text_samples
        and (step % text_every == 0 or step == self.cfg.total_steps)):
      self.hooks.samples(step, self._decoded_samples(self.cfg.metrics.num_text_samples))
    if self.hooks.after_step is not None:
      out = self.hooks.after_step(rec, self)
      if asyncio.iscoroutine(out):
        await out
    every_log = self.cfg.log_every
    if every_log > 0 and (step % every_log == 0 or step == self.cfg.total_steps):
      log.info("%s", log_line(rec))
    if self.hooks.progress is not None:
      self.hooks.progress.update(1)
      self.hooks.progress.set_postfix(
          reward=f"{rec['reward_mean']:.3f}", bubble=f"{rec['bubble_ratio']:.2f}",
          tok_s=f"{rec['trained_tokens_per_s']:.0f}",
      )
    ck = self.cfg.checkpoint.every_steps
    if self.hooks.checkpoint_fn is not None and ck > 0 and step % ck == 0:
      await self._checkpoint(step)

  def _decoded_samples(self, n: int) -> list[dict[str, Any]]:
    """The first ``n`` trajectories of the last trained batch, decoded."""
    return [{"sample": f"{t.sample_id}-{t.member}", "prompt": t.prompt.text,
             "completion": self.tokenizer.decode(t.completion_tokens.tolist()),
             "reward": float(t.reward)} for t in self._last_trained[:n]]

  async def _checkpoint(self, step: int) -> None:
    """Saves the run at ``step``: learner state, stream position, pending prompts.

    The pending prompts and the stream position are captured together, in
    one synchronous block on the event loop (where the producer draws
    prompts), before the write moves to a thread: a prompt drawn while the
    write runs is then in neither and is replayed by the stream on resume.
    Captured separately, a prompt drawn in between was neither pending nor
    replayable: lost on resume.
    """
    pending = self.pending_prompts()
    stream_state = self.prompt_source.get_state()
    await asyncio.to_thread(self.hooks.checkpoint_fn, step, pending, stream_state)

  # ----------------------------------------------------------- eval (compat)
  @property
  def eval_prompts(self) -> list[Prompt]:
    return self.evaluator.prompts

  @property
  def last_eval_completions(self) -> list[tuple[int, str, int]]:
    return self.evaluator.last_completions

  # -------------------------------------------------------------- task control
  def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
    """A background task the run waits for (briefly) and cancels at shutdown."""
    task = asyncio.ensure_future(coro)
    self._bg_tasks.add(task)
    task.add_done_callback(self._bg_tasks.discard)
    return task

  def kick_producer(self) -> None:
    self.strategy.kick()

  def request_stop(self) -> None:
    self.stopping = True
    self.strategy.stop()

  def fail(self, err: BaseException) -> None:
    """Records the first fatal error of a background task and stops the run."""
    if self._fatal is None:
      log.error("stopping the run: %s", err)
      self._fatal = err
    self.stopping = True
    self._pool_changed.set()
    self.kick_producer()

  def steps_left(self) -> bool:
    budget = self.cfg.max_wall_time_s
    if budget > 0 and time.time() - self._t0 >= budget:
      return False
    return self.learner.step < self.cfg.total_steps

  def is_last_step(self) -> bool:
    return self.learner.step + 1 >= self.cfg.total_steps

  # ---------------------------------------------------------------------- run
  async def run(self) -> dict[str, Any]:
    """Runs until ``cfg.total_steps`` learner steps; returns a summary."""
    self._t0 = time.time()
    await self.dispatcher.broadcast_version(self.version)
    initial_eval = await self.evaluator.evaluate() if self.cfg.eval.at_start else None
    initial_metrics = dict(self.evaluator.last_metrics) if initial_eval is not None else {}
    await self._telemetry.sample(self.dispatcher.live_clients)  # baseline for the first delta
    self._t0 = time.time()
    try:
      await self.strategy.run()
      await self._background.flush()  # the final eval and checkpoint see the last version
    finally:
      await self._shutdown()
    final_eval = await self.evaluator.evaluate()
    elapsed = time.time() - self._t0
    for p in self.pending_prompts():
      self.ledger.pending(p.sample_id)
    summary = {
        "mode": self.mode,
        "steps": self.learner.step,
        "wall_time_s": elapsed,
        "trained_tokens": self._trained_tokens,
        "trained_tokens_per_s": self._trained_tokens / max(elapsed, 1e-9),
        # GRPO groups trained by this incarnation (what rejected_groups is a share of).
        "trained_groups": self._trained_groups,
        "initial_eval_reward": initial_eval,
        "final_eval_reward": final_eval,
        "final_eval_reward_stderr": self.evaluator.last_stderr,
        # pass@1 / pass@k / maj@k (+ standard errors) before and after training.
        "initial_eval": initial_metrics,
        "final_eval": dict(self.evaluator.last_metrics) if final_eval is not None else {},
        "wasted_rollout_tokens": self._wasted_tokens,
        "generated_tokens": self._generated_tokens,
        "integrity_violations": await self._final_audit(),
        # Groups that left without training, by reason (stale, pace_*, zero_variance).
        "rejected_groups": {dynamic_sampling.REASON: 0, "stale": 0, **self.ledger.reasons()},
    }
    summary["audit"] = dict(self.audit_counts)
    if self.tool_loop is not None:
      summary["tool_audit"] = self.tool_audit
      summary["tools"] = self.tool_executor.metrics()
    if self.hooks.checkpoint_fn is not None:
      await self._checkpoint(self.learner.step)
    return summary

  async def _final_audit(self) -> list[str]:
    """Every violation of the run: the ledger's bookkeeping, the data re-derived (the
    sample's remaining version labels, its rewards re-scored, the snapshots checked)
    and the tool calls re-run; ``audit_counts`` gets the verdict by kind."""
    await self._verify_labels(drain=True)
    violations, rescored = await self.reward_audit.check(self.scorer, self.tokenizer)
    for message in violations:
      self.ledger.audit_failure("rewards", message)
    tools = await self._recheck_tools()
    self.audit_sample.close()
    counts = {"rewards_rescored": rescored}
    if self.snapshot_audit is not None:
      counts["snapshots_checked"] = self.snapshot_audit.checked
    if self.label_audit is not None and self.label_audit.active:
      counts.update(labels_checked=self.label_audit.checked,
                    labels_unverifiable=self.label_audit.unverifiable,
                    labels_skipped=self.label_audit.skipped,
                    label_check_s=self._audit_total_s,
                    label_max_mean_abs_diff=self.label_audit.largest)
    self.audit_counts.update(counts, violations={**self.ledger.verdict(), "tool_calls": len(tools)})
    return self.ledger.check() + tools

  async def _recheck_tools(self) -> list[str]:
    """The audit's tool check: re-run a sample of the trained tool calls (multi-turn runs)."""
    if self.tool_loop is None:
      return []
    violations, counts = await recheck_tool_calls(
        self.ledger.trained_records(), self.tool_loop, sample=TOOL_AUDIT_SAMPLE,
        seed=self.cfg.seed)
    self.tool_audit = counts
    return violations

  async def _shutdown(self) -> None:
    self.request_stop()
    await self.dispatcher.abort_all()
    if self._bg_tasks:
      await asyncio.wait(list(self._bg_tasks), timeout=30)
    for t in list(self._bg_tasks):
      t.cancel()
