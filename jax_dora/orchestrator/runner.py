"""The host-side asyncio orchestrator: one loop per training mode.

Every mode shares the same pieces — a prompt source, a :class:`Dispatcher`
over rollout servers, the trajectory pool, the learner and the snapshot
publisher — and differs only in *when* it generates and *which* policy version
a request may use:

* ``sync``: generate a full batch on the current version, wait for the
  slowest trajectory, train, publish. The baseline every other mode is
  measured against.
* ``one_step_off``: batch k+1 is generated (pinned to the version before
  update k) while the learner trains on batch k. Staleness is exactly 1.
* ``partial_rollout``: generate until a batch worth of groups has finished,
  abort the rest, train, then resume the aborted rollouts from their prefix
  on the new version (their spans record every version that wrote them).
* ``async_unfiltered``: generation never stops; servers hold one version, so
  every publish interrupts in-flight rollouts, which resume on the new
  version (AReaL-style). Only the hard staleness bound filters data.
* ``dora``: multi-version streaming rollout. Servers hold several versions; a
  trajectory finishes on the version it started with; new requests start on
  the newest; finished trajectories stream into the pool and the learner
  trains as soon as a batch of complete groups exists.
* ``dora_pace``: ``dora`` plus PACE rejection of the stalest completed groups
  when the pool holds more than its target.

The three DORA constraints are enforced here and audited by the
:class:`IntegrityLedger`: intra-trajectory consistency (requests are never
interrupted in ``dora``/``dora_pace``/``sync``/``one_step_off``), data integrity
(every issued sample is trained once, rejected with a logged reason and
regenerated, or carried to the next run as pending), bounded staleness (the
pool evicts groups older than ``max_staleness`` and the producer never has
more samples outstanding than can be consumed within the bound).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jax_dora.learner.batching import bucket_length, make_batch, parse_buckets
from jax_dora.learner.grpo import group_advantages
from jax_dora.metrics.histogram import staleness_histogram
from jax_dora.orchestrator import staleness as staleness_lib
from jax_dora.orchestrator.dispatch import Dispatcher, to_trajectory
from jax_dora.orchestrator.integrity import IntegrityLedger
from jax_dora.orchestrator.pace import PaceConfig, PaceController
from jax_dora.orchestrator.pool import TrajectoryPool
from jax_dora.types import Prompt, Trajectory

log = logging.getLogger(__name__)

STREAMING_MODES = ("async_unfiltered", "dora", "dora_pace")
# Modes whose rollouts may start before the newest version is loaded, so the
# Orbax write can leave the learner's critical path. sync and partial_rollout
# must load the new version before generating again; one_step_off's next batch
# must start on the version of the step just taken (staleness exactly 1).
BACKGROUND_PUBLISH_MODES = STREAMING_MODES


@dataclasses.dataclass
class StepTiming:
  """Wall-clock accounting for one learner step."""

  wait_s: float = 0.0  # learner idle: waiting for a batch (the bubble)
  train_s: float = 0.0
  publish_s: float = 0.0


def _log_line(rec: dict[str, Any]) -> str:
  """One readable line per logged step (for runs read from a log file)."""
  beh = rec.get("staleness_behaviour") or {}
  parts = [
      f"step {rec['step']}",
      f"reward {rec['reward_mean']:.3f}",
      f"len {rec['completion_len_mean']:.0f}",
      f"loss {rec.get('train/loss', float('nan')):.4f}",
      f"bubble {rec['bubble_ratio']:.2f}",
      f"{rec['trained_tokens_per_s']:.0f} tok/s",
      f"staleness mean {beh.get('mean') or 0:.2f} max {beh.get('max') or 0}",
      f"pool {rec['pool_groups']}",
  ]
  if rec.get("eval_reward") is not None:
    parts.append(f"eval {rec['eval_reward']:.3f}")
  return " | ".join(parts)


class Orchestrator:
  """Drives one training run in the configured mode."""

  def __init__(
      self,
      cfg: Any,
      *,
      learner: Any,
      publisher: Any,
      dispatcher: Dispatcher,
      prompt_source: Any,
      tokenizer: Any,
      scorer: Any,
      metrics: Any,
      ledger: IntegrityLedger,
      eval_prompts: Sequence[Prompt] = (),
      checkpoint_fn: Callable[[int, list[Prompt], dict[str, Any]], None] | None = None,
      pending_prompts: Sequence[Prompt] = (),
      progress: Any = None,
      after_step: Callable[[dict[str, Any], "Orchestrator"], Any] | None = None,
      incarnation: str = "",
  ):
    self.cfg = cfg
    self.mode = cfg.mode
    self.learner = learner
    self.publisher = publisher
    self.dispatcher = dispatcher
    self.prompt_source = prompt_source
    self.tokenizer = tokenizer
    # Awaitable ``score(prompt, completion_text) -> float``
    # (``jax_dora.rewards.RewardScorer``): verifiers may run in worker processes.
    self.scorer = scorer
    self.metrics = metrics
    self.ledger = ledger
    self.eval_prompts = list(eval_prompts)
    self.checkpoint_fn = checkpoint_fn
    self.progress = progress
    # Called after every learner step with the step's metrics record (may be
    # async): the extension point for callbacks, fault injection in tests, etc.
    self.after_step = after_step
    # This run's incarnation (jax_dora.snapshots): a trajectory generated by
    # another incarnation's versions is never trained.
    self.incarnation = incarnation

    self.group_size = int(cfg.learner.group_size)
    self.groups_per_step = int(cfg.learner.groups_per_step)
    self.max_staleness = int(cfg.orchestrator.max_staleness)
    self.max_new_tokens = int(cfg.rollout.max_new_tokens)
    self.fixed_lengths = cfg.rollout.length_mode == "answer"
    self.version = int(learner.step)  # newest published policy version
    self.pool = TrajectoryPool(self.group_size, self.max_staleness)
    self._seq_buckets = parse_buckets(
        str(cfg.learner.seq_len_buckets), int(cfg.model.max_seq_len))
    self.pace = (
        PaceController(PaceConfig.from_config(cfg.pace)) if self.mode == "dora_pace" else None
    )
    # Prompts to (re)generate before drawing new ones: carried over from a
    # resumed run, or rejected by PACE / evicted as stale.
    self._regenerate: collections.deque[Prompt] = collections.deque(pending_prompts)
    # Prompts issued and not yet trained, by sample id (for checkpoints).
    self._outstanding: dict[int, Prompt] = {}
    self._pool_changed = asyncio.Event()
    self._stop = False
    self._fatal: BaseException | None = None
    self._bg_tasks: set[asyncio.Task] = set()
    self._pause_resumes = False
    self._resume_gate = asyncio.Event()
    self._resume_gate.set()
    self._t0 = time.time()
    self._trained_tokens = 0
    self._generated_tokens = 0
    self._last_status: dict[str, tuple[float, float, int, int]] = {}
    # Set once the streaming producer starts: its wake-up condition and the
    # servers' slot + queue capacity it keeps busy.
    self._produce_cond_live: asyncio.Condition | None = None
    self._rollout_capacity: int | None = None
    # Background publishing (asynchronous modes): see _queue_publish.
    self._publish_in_background = (
        bool(cfg.orchestrator.async_publish) and self.mode in BACKGROUND_PUBLISH_MODES
    )
    self._publish_next: tuple[int, Any] | None = None
    self._publish_task: asyncio.Task | None = None
    self._published_version = self.version
    self._publish_skipped = 0
    self._publish_background_s = 0.0
    self.last_eval_stderr: float | None = None
    self.last_eval_completions: list[tuple[int, str, int]] = []
    self._eval_reruns = 0

  # ------------------------------------------------------------------ prompts
  def _next_prompt(self) -> Prompt:
    p = self._regenerate.popleft() if self._regenerate else self.prompt_source.next_prompt()
    self._outstanding[p.sample_id] = p
    return p

  def _prompt_tokens(self, p: Prompt) -> np.ndarray:
    # BOS / chat template as the tokenizer defines them for prompts.
    return np.asarray(self.tokenizer.encode_prompt(p.text), np.int32)

  def _length_budget(self, p: Prompt) -> tuple[int, bool]:
    """``(max_new_tokens, ignore_eos)`` for a request on ``p`` (``rollout.length_mode``)."""
    if not self.fixed_lengths:
      return self.max_new_tokens, False
    n = len(self.tokenizer.encode(p.answer, is_bos=False)[0])
    return max(1, min(n, self.max_new_tokens)), True

  # ----------------------------------------------------------------- rollouts
  async def _rollout_member(
      self, prompt: Prompt, member: int, version: int | None, *, interruptible: bool
  ) -> Trajectory:
    """Generates one trajectory, resuming it after interruptions if allowed."""
    tokens = self._prompt_tokens(prompt)
    submit = time.time()
    self.ledger.issued(prompt.sample_id, member, self.version)
    partial: Trajectory | None = None
    budget, ignore_eos = self._length_budget(prompt)
    foreign = 0
    while True:
      result = await self.dispatcher.run(
          prompt, tokens, member, budget, version=version, resume=partial,
          ignore_eos=ignore_eos,
      )
      why = self._foreign(result.incarnation, result.spans)
      if why is not None:
        # Servers refuse requests of another incarnation, so this is a server
        # bug or a stale server: never train on it; re-issue (bounded).
        foreign += 1
        self.ledger.reissued(prompt.sample_id, member, why)
        log.error("discarding %s-%d: %s", prompt.sample_id, member, why)
        if foreign >= 3:
          raise RuntimeError(f"sample {prompt.sample_id}-{member}: {why} ({foreign} times)")
        continue
      traj = to_trajectory(prompt, tokens, member, result, submit)
      traj.incarnation = result.incarnation
      if traj.finish_reason != "aborted":
        break
      if not interruptible or self._stop:
        return traj
      partial = traj
      if self._pause_resumes:
        await self._resume_gate.wait()
      if self._stop:
        return traj
    traj.finish_version = self.version
    traj.reward = float(await self.scorer.score(
        prompt, self.tokenizer.decode(traj.completion_tokens.tolist())))
    self._generated_tokens += traj.num_completion_tokens
    self.ledger.finished(traj)
    return traj

  def _foreign(self, incarnation: str, spans: Sequence[Any]) -> str | None:
    """Why a result cannot come from this run's policy versions (None if it can)."""
    if self.incarnation and incarnation != self.incarnation:
      return f"generated by run incarnation {incarnation!r}, not this run's {self.incarnation!r}"
    newer = [sp.version for sp in spans if sp.version > self.version]
    if newer:
      return f"span from version {max(newer)} newer than learner version {self.version}"
    return None

  async def _rollout_group(
      self, prompt: Prompt, version: int | None = None, *, interruptible: bool = False
  ) -> list[Trajectory]:
    return list(
        await asyncio.gather(
            *(
                self._rollout_member(prompt, m, version, interruptible=interruptible)
                for m in range(self.group_size)
            )
        )
    )

  async def _generate_batch(self, version: int | None) -> list[list[Trajectory]]:
    prompts = [self._next_prompt() for _ in range(self.groups_per_step)]
    return list(await asyncio.gather(*(self._rollout_group(p, version) for p in prompts)))

  # ------------------------------------------------------------------ learner
  async def _train(self, groups: list[list[Trajectory]], timing: StepTiming) -> dict[str, Any]:
    """One learner step on complete groups, then publish the new version."""
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
    adv = group_advantages(
        rewards,
        self.group_size,
        eps=self.cfg.learner.advantage_eps,
        normalize_std=self.cfg.learner.normalize_adv_std,
    )
    seq_len = bucket_length(trajs, self._seq_buckets)
    batch = make_batch(trajs, adv, seq_len, self.tokenizer.pad_id)
    t0 = time.time()
    train_metrics = await asyncio.to_thread(self.learner.train_step, batch)
    timing.train_s = time.time() - t0
    step = self.learner.step
    self.ledger.trained(trajs, learner_version=self.version, step=step)
    for g in groups:
      self._outstanding.pop(g[0].sample_id, None)
    self._trained_tokens += int(sum(t.num_completion_tokens for t in trajs))

    t0 = time.time()
    new_version = self.version + 1
    if self._publish_in_background:
      # Only the copy blocks the learner: the next (donating) train step may
      # start while Orbax writes this one.
      snapshot = await asyncio.to_thread(self.learner.detached_params, new_version)
      self.version = new_version
      self._queue_publish(new_version, snapshot)
    else:
      await asyncio.to_thread(
          self.publisher.publish, new_version, self.learner.params, {"step": step}
      )
      self.version = new_version
    timing.publish_s = time.time() - t0
    return self._step_record(step, trajs, train_metrics, timing)

  # -------------------------------------------------------------- publishing
  def _queue_publish(self, version: int, params: Any) -> None:
    """Publishes ``version`` in the background, newest first.

    One Orbax write is in flight at a time. Versions the learner produces
    while one is being written are coalesced: only the newest is published
    next (rollout servers only ever start new requests on the newest
    version, so an intermediate snapshot nobody would load is skipped).
    Staleness is still counted in learner versions, so a skipped publish can
    only make data staler, never hide it from the bound.
    """
    if self._publish_next is not None:
      self._publish_skipped += 1
    self._publish_next = (version, params)
    if self._publish_task is None or self._publish_task.done():
      self._publish_task = self._spawn(self._publish_loop())

  async def _publish_loop(self) -> None:
    try:
      while self._publish_next is not None:
        version, params = self._publish_next
        self._publish_next = None
        t0 = time.time()
        await asyncio.to_thread(self.publisher.publish, version, params, {"step": version})
        self._published_version = version
        self._publish_background_s = time.time() - t0
        await self._on_published(version)
    except Exception as e:  # pylint: disable=broad-exception-caught
      self._fail(e)

  async def _on_published(self, version: int) -> None:
    """Makes servers load ``version`` (background publishing only)."""
    if self.mode == "async_unfiltered":
      # One version per server: load it, then interrupt in-flight rollouts
      # so they resume on it (their prefix keeps its old-version span).
      await self._load_then_interrupt(version)
    else:
      await self.dispatcher.broadcast_version(version)
    self._kick_producer()

  async def _flush_publish(self) -> None:
    """Waits until the newest learner version is published and loaded."""
    while self._publish_task is not None and not self._publish_task.done():
      await asyncio.shield(self._publish_task)

  def _step_record(self, step, trajs, train_metrics, timing: StepTiming) -> dict[str, Any]:
    v = self.version - 1  # the version the batch was trained at
    gen = [staleness_lib.generation_staleness(t, t.finish_version) for t in trajs]
    wait = [staleness_lib.waiting_staleness(t, v) for t in trajs]
    eff = [staleness_lib.effective_staleness(t, v) for t in trajs]
    beh = [staleness_lib.behaviour_staleness(t, v) for t in trajs]
    elapsed = time.time() - self._t0
    step_total = timing.wait_s + timing.train_s + timing.publish_s
    rec = {
        "step": step,
        "version": self.version,
        "mode": self.mode,
        "reward_mean": float(np.mean([t.reward for t in trajs])),
        "completion_len_mean": float(np.mean([t.num_completion_tokens for t in trajs])),
        "completion_len_max": int(max(t.num_completion_tokens for t in trajs)),
        "trained_tokens": int(sum(t.num_completion_tokens for t in trajs)),
        "trained_tokens_per_s": self._trained_tokens / max(elapsed, 1e-9),
        "generated_tokens_per_s": self._generated_tokens / max(elapsed, 1e-9),
        "learner_wait_s": timing.wait_s,
        "learner_train_s": timing.train_s,
        # Learner-blocking publish time (only the device copy when publishing
        # in the background); the Orbax write itself is publish_background_s.
        "publish_s": timing.publish_s,
        "published_version": self._published_version,
        "publish_background_s": self._publish_background_s,
        "publish_skipped_total": self._publish_skipped,
        "step_time_s": step_total,
        # Learner idle share of the step. In sync mode this is exactly the
        # rollout share of step time (the learner waits for the whole batch).
        "bubble_ratio": timing.wait_s / max(step_total, 1e-9),
        "pool_groups": self.pool.occupancy(),
        "staleness_generation": staleness_histogram(gen),
        "staleness_waiting": staleness_histogram(wait),
        "staleness_effective": staleness_histogram(eff),
        "staleness_behaviour": staleness_histogram(beh),
        "multi_version_trajectories": int(sum(len(t.behaviour_versions) > 1 for t in trajs)),
        "wall_time_s": elapsed,
    }
    rec.update({f"train/{k}": v for k, v in train_metrics.items()})
    # Verifier timeouts / crashes / errors so far (each scored 0).
    rec.update(self.scorer.metrics())
    return rec

  # --------------------------------------------------------------- telemetry
  async def _rollout_telemetry(self) -> dict[str, float | None]:
    """Rollout idle share and decode passes per step since the previous call.

    ``rollout_idle_ratio`` = 1 - busy share of the servers' wall time;
    ``decode_passes_per_step`` = live versions per decode step (1.0 = no
    multi-version overhead; each extra held-and-pinned version costs a pass).
    """
    ratios, steps, passes = [], 0, 0
    for c in self.dispatcher.live_clients:
      try:
        st = await c.status()
      except Exception:  # pylint: disable=broad-exception-caught
        continue
      now = time.time()
      prev = self._last_status.get(c.name)
      self._last_status[c.name] = (now, st.busy_time_s, st.decode_steps, st.decode_passes)
      if prev is not None and now > prev[0]:
        ratios.append(1.0 - min(1.0, (st.busy_time_s - prev[1]) / (now - prev[0])))
        steps += st.decode_steps - prev[2]
        passes += st.decode_passes - prev[3]
    return {
        "rollout_idle_ratio": float(np.mean(ratios)) if ratios else None,
        "decode_passes_per_step": passes / steps if steps else None,
    }

  async def evaluate(self) -> float | None:
    """Mean reward on held-out prompts at the newest version (one sample each)."""
    if not self.eval_prompts:
      return None

    async def one(p: Prompt) -> float:
      budget, ignore_eos = self._length_budget(p)
      while True:
        # The dispatcher never aborts eval requests on a publish; any other
        # abort (a server shutting down) re-runs the prompt from scratch:
        # a truncated completion is never scored.
        res = await self.dispatcher.run(
            p, self._prompt_tokens(p), 0, budget, tag="eval", ignore_eos=ignore_eos
        )
        if res.finish_reason != "aborted":
          break
        self._eval_reruns += 1
      finished.append((p.sample_id, res.finish_reason, len(res.completion_tokens)))
      return float(await self.scorer.score(
          p, self.tokenizer.decode(np.asarray(res.completion_tokens).tolist())))

    finished: list[tuple[int, str, int]] = []
    rewards = np.asarray(await asyncio.gather(*(one(p) for p in self.eval_prompts)), np.float64)
    # (sample id, finish reason, completion length) of every scored completion.
    self.last_eval_completions = sorted(finished)
    # Standard error of the mean: what a difference between two evals (two
    # modes, two checkpoints) has to exceed to mean anything.
    self.last_eval_stderr = (
        float(rewards.std(ddof=1) / np.sqrt(len(rewards))) if len(rewards) > 1 else None)
    return float(rewards.mean())

  async def _after_step(self, rec: dict[str, Any]) -> None:
    rec.update(await self._rollout_telemetry())
    step = rec["step"]
    every = int(self.cfg.eval.every_steps)
    if every > 0 and (step % every == 0 or step == self.cfg.total_steps):
      rec["eval_reward"] = await self.evaluate()
    self.metrics.write(rec)
    if self.after_step is not None:
      out = self.after_step(rec, self)
      if asyncio.iscoroutine(out):
        await out
    every_log = int(self.cfg.log_every)
    if every_log > 0 and (step % every_log == 0 or step == self.cfg.total_steps):
      log.info("%s", _log_line(rec))
    if self.progress is not None:
      self.progress.update(1)
      self.progress.set_postfix(
          reward=f"{rec['reward_mean']:.3f}", bubble=f"{rec['bubble_ratio']:.2f}",
          tok_s=f"{rec['trained_tokens_per_s']:.0f}",
      )
    ck = int(self.cfg.checkpoint.every_steps)
    if self.checkpoint_fn is not None and ck > 0 and step % ck == 0:
      await self._checkpoint(step)

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
    await asyncio.to_thread(self.checkpoint_fn, step, pending, stream_state)

  def pending_prompts(self) -> list[Prompt]:
    """Prompts issued but not trained: re-issued by a resumed run."""
    seen = {p.sample_id: p for p in self._regenerate}
    seen.update(self._outstanding)
    return [seen[k] for k in sorted(seen)]

  # ------------------------------------------------------------------- modes
  async def run(self) -> dict[str, Any]:
    """Runs until ``cfg.total_steps`` learner steps; returns a summary."""
    self._t0 = time.time()
    await self.dispatcher.broadcast_version(self.version)
    initial_eval = await self.evaluate() if self.cfg.eval.at_start else None
    await self._rollout_telemetry()  # baseline for the first delta
    self._t0 = time.time()
    runner = {
        "sync": self._run_sync,
        "one_step_off": self._run_one_step_off,
        "partial_rollout": self._run_partial_rollout,
        "async_unfiltered": self._run_streaming,
        "dora": self._run_streaming,
        "dora_pace": self._run_streaming,
    }[self.mode]
    try:
      await runner()
      await self._flush_publish()  # the final eval and checkpoint see the last version
    finally:
      await self._shutdown()
    final_eval = await self.evaluate()
    elapsed = time.time() - self._t0
    for p in self.pending_prompts():
      self.ledger.pending(p.sample_id)
    summary = {
        "mode": self.mode,
        "steps": self.learner.step,
        "wall_time_s": elapsed,
        "trained_tokens": self._trained_tokens,
        "trained_tokens_per_s": self._trained_tokens / max(elapsed, 1e-9),
        "initial_eval_reward": initial_eval,
        "final_eval_reward": final_eval,
        "final_eval_reward_stderr": self.last_eval_stderr,
        "integrity_violations": self.ledger.check(),
    }
    if self.checkpoint_fn is not None:
      await self._checkpoint(self.learner.step)
    return summary

  def _steps_left(self) -> bool:
    budget = float(self.cfg.max_wall_time_s)
    if budget > 0 and time.time() - self._t0 >= budget:
      return False
    return self.learner.step < self.cfg.total_steps

  async def _run_sync(self) -> None:
    while self._steps_left():
      timing = StepTiming()
      t0 = time.time()
      groups = await self._generate_batch(self.version)
      timing.wait_s = time.time() - t0
      rec = await self._train(groups, timing)
      await self.dispatcher.broadcast_version(self.version)
      await self._after_step(rec)

  async def _run_one_step_off(self) -> None:
    """Batch k+1 is generated by version k while the learner takes step k+1.

    Every batch after the first is trained exactly one version after the one
    that generated it. The servers load a new version only between batches:
    once the batch generated by the previous version has finished (nothing
    pinned to it any more) the version just trained is loaded, and the next
    batch is pinned to it, while the learner trains. Starting the next batch
    before that load finished let it start on the version before (two steps
    stale); loading while a pinned batch still queued could free its version.
    """
    next_batch = asyncio.create_task(self._generate_batch(self.version))
    while self._steps_left():
      timing = StepTiming()
      t0 = time.time()
      groups = await next_batch
      timing.wait_s = time.time() - t0
      loading = self._spawn(self.dispatcher.broadcast_version(self.version))
      if self.learner.step + 1 < self.cfg.total_steps:
        next_batch = asyncio.create_task(self._generate_after(loading, self.version))
      rec = await self._train(groups, timing)
      await self._after_step(rec)

  async def _generate_after(self, loading: asyncio.Task, version: int) -> list[list[Trajectory]]:
    await loading
    return await self._generate_batch(version)

  def _spawn(self, coro) -> asyncio.Task:
    task = asyncio.create_task(coro)
    self._bg_tasks.add(task)
    task.add_done_callback(self._bg_tasks.discard)
    return task

  # Streaming modes -----------------------------------------------------------
  def _capacity_samples(self) -> int:
    """Outstanding samples allowed: enough to keep slots busy, never more than
    can be consumed before exceeding the staleness bound (AReaL's rule).

    A request issued now starts on a version at best as new as the newest
    *published* one, which lags the learner while a background publish is in
    flight; that lag is already spent of the bound, so it shrinks the budget.
    """
    batch = self.groups_per_step * self.group_size
    lag = max(0, self.version - self._published_version)
    return max(1, self.max_staleness + 1 - lag) * batch

  async def _count_rollout_slots(self) -> None:
    """Decode slots (+ ``queue_depth`` per server) the producer keeps busy."""
    slots = servers = 0
    for c in self.dispatcher.live_clients:
      try:
        slots += int((await c.status()).total_slots)
        servers += 1
      except Exception:  # pylint: disable=broad-exception-caught
        continue
    depth = int(self.cfg.orchestrator.queue_depth)
    self._rollout_capacity = slots + depth * servers if servers else None

  def _may_issue(self, in_flight: int) -> bool:
    """Admission rule for one more group (``in_flight``: rollout requests not
    yet finished; finished members of incomplete groups are in the pool).

    Two caps: AReaL's hard rule (in flight + everything pooled <=
    ``(max_staleness + 1) * batch``), and a working-set cap: in flight plus
    *complete* pooled groups <= one batch + the servers' slots and queues.
    Work beyond the second cap could only wait in a queue or in the pool while
    versions advance, to be evicted as stale; below it every slot stays busy
    and the learner finds its next batch ready. Counting requests rather than
    whole unfinished groups matters under long tails: a group whose short
    members are done and whose long one still runs holds one slot, not
    ``group_size`` (counted as a group, such groups starved the servers of
    work: ~30% of their slot time idle).
    """
    g = self.group_size
    if in_flight + self.pool.num_trajectories() + g > self._capacity_samples():
      return False
    cap = self._rollout_capacity
    if cap is None:
      return True
    batch = self.groups_per_step * g
    return in_flight + self.pool.num_complete_groups() * g + g <= batch + max(cap, g)

  def _add_to_pool(self, t: Trajectory) -> None:
    self.pool.add(t, self.version)
    self._pool_changed.set()

  def _reject(self, groups: list[list[Trajectory]], reason: str | Sequence[str]) -> None:
    """Records rejected/evicted groups; their prompts are regenerated or dropped.

    Stale evictions are always regenerated (the sample was never trained);
    PACE rejections follow ``pace.on_reject``.
    """
    reasons = [reason] * len(groups) if isinstance(reason, str) else list(reason)
    for g, why in zip(groups, reasons):
      regenerate = why == "stale" or self.cfg.pace.on_reject == "regenerate"
      self.ledger.rejected(g, why, regenerate=regenerate, version=self.version)
      self._outstanding.pop(g[0].sample_id, None)
      if regenerate:
        self._regenerate.append(g[0].prompt)
      else:
        log.info("dropping group %d (%s)", g[0].sample_id, why)
    if groups:
      self._kick_producer()

  def _kick_producer(self) -> None:
    cond = self._produce_cond_live
    if cond is not None:
      async def notify():
        async with cond:
          cond.notify_all()
      self._spawn(notify())

  def _fail(self, err: BaseException) -> None:
    """Records the first fatal error of a background task and stops the run."""
    if self._fatal is None:
      log.error("stopping the run: %s", err)
      self._fatal = err
    self._stop = True
    self._pool_changed.set()
    self._kick_producer()

  async def _wait_batch(self) -> list[list[Trajectory]]:
    while True:
      if self._fatal is not None:
        raise self._fatal
      evicted = self.pool.evict_stale(self.version)
      self._reject(evicted, "stale")
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
          self._pace_rejected += len(rejected)
      if self.pool.num_complete_groups() >= self.groups_per_step:
        return self.pool.pop_groups(self.groups_per_step)
      self._pool_changed.clear()
      await self._pool_changed.wait()

  async def _run_streaming(self) -> None:
    interruptible = self.mode == "async_unfiltered"
    self._pace_rejected = 0
    producer = self._spawn(self._produce_with_handle(interruptible))
    try:
      while self._steps_left():
        timing = StepTiming()
        t0 = time.time()
        groups = await self._wait_batch()
        timing.wait_s = time.time() - t0
        rec = await self._train(groups, timing)
        rec["pace_rejected_total"] = self._pace_rejected
        rec["stale_evicted_total"] = self.ledger.count("stale")
        if self.pace is not None:
          rec["pace"] = self.pace.stats()
        if not self._publish_in_background:
          self._spawn(self._on_published(self.version))
        self._kick_producer()
        await self._after_step(rec)
    finally:
      self._stop = True
      self._kick_producer()
      producer.cancel()

  async def _produce_with_handle(self, interruptible: bool) -> None:
    # Expose the producer's condition so rejections / steps can wake it.
    outstanding = {"n": 0}
    cond = asyncio.Condition()
    self._produce_cond_live = cond
    await self._count_rollout_slots()

    async def member_task(p: Prompt, m: int) -> Trajectory:
      try:
        return await self._rollout_member(p, m, None, interruptible=interruptible)
      finally:
        outstanding["n"] -= 1
        self._kick_producer()

    async def group_task(p: Prompt):
      members: list[asyncio.Task] = []
      try:
        members = [asyncio.create_task(member_task(p, m)) for m in range(self.group_size)]
        for fut in asyncio.as_completed(members):
          t = await fut
          if t.finish_reason == "aborted":
            continue
          self._add_to_pool(t)
      except asyncio.CancelledError:
        raise
      except Exception as e:  # pylint: disable=broad-exception-caught
        # E.g. every rollout server is gone: stop the run loudly instead of
        # spinning on prompts that can never be generated.
        for m in members:
          m.cancel()
        self._fail(e)

    while not self._stop:
      async with cond:
        await cond.wait_for(
            lambda: self._stop or self._may_issue(outstanding["n"])
        )
      if self._stop:
        break
      p = self._next_prompt()
      outstanding["n"] += self.group_size
      self._spawn(group_task(p))
      await asyncio.sleep(0)

  async def _load_then_interrupt(self, version: int) -> None:
    await self.dispatcher.broadcast_version(version)
    await self.dispatcher.abort_all()

  async def _run_partial_rollout(self) -> None:
    """Generate until a batch is complete, abort the tail, train, resume."""
    self._pause_resumes = True
    self._pace_rejected = 0
    producer = self._spawn(self._produce_with_handle(interruptible=True))
    try:
      while self._steps_left():
        timing = StepTiming()
        t0 = time.time()
        self._resume_gate.set()
        groups = await self._wait_batch()
        timing.wait_s = time.time() - t0
        # Stop the tail: aborted rollouts wait at the gate until the new
        # version is loaded, then resume from their prefix.
        self._resume_gate.clear()
        await self.dispatcher.abort_all()
        rec = await self._train(groups, timing)
        await self.dispatcher.broadcast_version(self.version)
        self._kick_producer()
        await self._after_step(rec)
    finally:
      self._stop = True
      self._resume_gate.set()
      self._kick_producer()
      producer.cancel()

  async def _shutdown(self) -> None:
    self._stop = True
    self._resume_gate.set()
    await self.dispatcher.abort_all()
    if self._bg_tasks:
      await asyncio.wait(list(self._bg_tasks), timeout=30)
    for t in list(self._bg_tasks):
      t.cancel()
