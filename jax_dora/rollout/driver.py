"""The continuous-batching rollout loop (one per server), shared by both front ends.

Modelled on JetStream's ``orchestrator.Driver`` (prefill -> insert into a free
slot -> generate steps -> detokenize/return, refilling a slot as soon as it
frees), collapsed into one background thread because our models are small and
the interesting part is elsewhere: every slot is pinned to the policy version
that prefilled it, several versions decode side by side, and the
:class:`~jax_dora.rollout.version_store.VersionStore` keeps at most
``max_versions`` of them in memory. A request's path (DESIGN.md, "The rollout
server"): queue -> admission (``admission.py``: version pin, context, budget)
-> slot (``slot_table.py``: position, buffers, the step's hint) -> programs
(``engine.py``) -> stop conditions (``stop_conditions.py``) -> output
(``request_output.py``). Versions, incarnations and holds: ``versions.py``.

Threading: public methods may be called from any thread; they only touch
queues under a lock and wake the loop. All device work except parameter
loading happens on the driver thread, and every callback is invoked from it.
The hot path is asynchronous: an admission round is one batched prefill, and
step ``t+1`` is dispatched before step ``t``'s tokens are read
(``step_results.py``), so the host records tokens, checks stop conditions and
streams chunks while the device computes.

Every request ends with exactly one terminal callback: a
:class:`~jax_dora.rollout.api.RolloutResult` (``eos`` / ``length`` /
``stop`` / ``aborted``) or a :class:`~jax_dora.rollout.api.RolloutError`.
Nothing is silently dropped, including on :meth:`RolloutDriver.stop` and on a
crash of the loop.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from jax_dora.model import routing
from jax_dora.rollout import api
from jax_dora.rollout.admission import Admitted, Item, Queued, admit
from jax_dora.rollout.engine import DoraEngine
from jax_dora.rollout.engine_types import FirstToken, PrefillWork
from jax_dora.rollout.held_kv import HeldContext, HeldKV
from jax_dora.rollout.request_output import span_result, unstarted_result
from jax_dora.rollout.slot_table import Active, SlotTable
from jax_dora.rollout.step_results import DispatchedStep, first_tokens, step_tokens
from jax_dora.rollout.stop_conditions import StopConditions
from jax_dora.rollout.versions import ServerVersions

_log = logging.getLogger(__name__)

Callback = Callable[[Item], None]


class RolloutDriver:
  """Owns one engine's slots and runs its continuous-batching loop.

  Args:
    engine: The device engine (its slots are this driver's slots).
    snapshot_dir: Where :class:`SnapshotPublisher` writes versions.
    max_versions: Param versions held at once (see ``VersionStore``).
    name: Server name (logs, client ``name``).
    chunk_steps: Stream a chunk every this many steps per request (1 = every token).
    stop_on_eos: False: every request runs to its budget (benchmarks fix lengths).
    load_fn: ``(version, incarnation) -> params`` on this engine's devices
      (default: ``engine.load_params``; embedded servers share one loader). It
      must refuse a snapshot of another incarnation.
    precompile: Compile every device program before serving
      (``config.precompile``), so no request stalls on a compile mid-run.
    hold_timeout_s: A version hold not taken over or released within this
      long is released (its orchestrator is gone).
    held_kv_slots: Pool rows that keep a held turn's cache entries while its
      tool runs, so the next turn prefills only its new tokens
      (``held_kv.py``; ``rollout.held_kv_slots``). 0: every turn re-prefills.
  """

  def __init__(self, engine: DoraEngine, snapshot_dir: str, max_versions: int,
               name: str = "server0", *, chunk_steps: int = 1, stop_on_eos: bool = True,
               load_fn: Callable[[int, str | None], object] | None = None,
               precompile: bool = False, hold_timeout_s: float = 600.0,
               held_kv_slots: int = 0):
    self.engine = engine
    self.name = name
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self.versions = ServerVersions(snapshot_dir, max_versions, name, hold_timeout_s, load_fn,
                                   engine.load_params, self._wake, self.check_alive)
    self.chunk_steps = max(1, int(chunk_steps))
    self.stops = StopConditions(engine.tokenizer, stop_on_eos)
    self.num_slots = engine.max_concurrent_decodes
    self.slots = SlotTable(self.num_slots, engine.max_seq_len)
    self._pending_step: DispatchedStep | None = None
    self._device_free_at = 0.0
    self.prefill_work = PrefillWork()
    self._resumed_prefill_tokens = 0
    # Multi-turn: held turns' cache entries (the pool is allocated on the first park).
    self.held = HeldKV(held_kv_slots) if held_kv_slots > 0 else None
    self._pool = None
    self._queue: collections.deque[Queued] = collections.deque()
    self._aborts: set[str] = set()
    self._stopping = False
    self._dead: str | None = None  # set if the loop crashed
    self._generated = 0
    self._busy_s = 0.0
    self._steps = 0
    self._passes = 0  # sum over steps of live versions (one decode pass each)
    if precompile:
      t0 = time.perf_counter()
      engine.warmup(max_versions)
      if self.held is not None:
        engine.warmup_held(self.held.rows)
      _log.info("%s: compiled decode for up to %d versions in %.1fs", name, max_versions,
                time.perf_counter() - t0)
    self._state = engine.init_decode_state()
    self._thread = threading.Thread(target=self._run, name=f"rollout-driver-{name}", daemon=True)
    self._thread.start()

  # ============================================================ public API
  def load_version(self, version: int, incarnation: str | None = None,
                   source: Any = None) -> None:
    """Loads snapshot ``version`` (``ServerVersions.load_version``); ``source``: a reader
    for this one load (a transfer offer) instead of the server's own."""
    self.versions.load_version(version, incarnation, source)

  # The server's versions (``versions.py``): its store, holds, snapshot reader, incarnation.
  store = property(lambda self: self.versions.store)
  holds = property(lambda self: self.versions.holds)
  reader = property(lambda self: self.versions.reader)
  incarnation = property(lambda self: self.versions.incarnation)

  def submit(self, request: api.RolloutRequest, callback: Callback, *, stream: bool = True) -> None:
    """Queues ``request``; ``callback`` receives its chunks then one terminal item.

    ``stream=False`` skips the chunks (the terminal result carries every token).
    """
    with self._lock:
      err = None
      if self._stopping or self._dead:
        err = api.RolloutError(
            f"{self.name}: driver is {'stopped' if self._stopping else 'dead: ' + str(self._dead)}",
            (request.request_id,))
      else:
        self._queue.append(Queued(request, callback, stream))
        self._wake.notify_all()
    if err is not None:
      self._safe_call(callback, err)

  def abort(self, request_ids: list[str]) -> None:
    """Ends those requests (queued or active) with ``finish_reason="aborted"``; a hold id
    releases the hold."""
    with self._lock:
      self._aborts.update(request_ids)
      self._wake.notify_all()

  def status(self) -> api.ServerStatus:
    with self._lock:
      active = self.slots.active()
      return api.ServerStatus(
          versions_loaded=self.store.loaded, newest_version=self.store.newest,
          active_slots=len(active), total_slots=self.num_slots, queued_requests=len(self._queue),
          slot_versions=tuple(s.version for s in active), incarnation=self.versions.incarnation or "",
          generated_tokens=self._generated, busy_time_s=self._busy_s, decode_steps=self._steps,
          decode_passes=self._passes,
          prefill_requested_tokens=self.prefill_work.requested_tokens,
          prefill_computed_tokens=self.prefill_work.computed_tokens,
          resumed_prefill_tokens=self._resumed_prefill_tokens,
          held_versions=self.holds.held_versions,
          **self._held_kv_status(),
          snapshot_integrity_failures=self.versions.integrity_failures)

  def stop(self, timeout_s: float = 30.0) -> None:
    """Stops the loop; every in-flight request gets a RolloutError with all their ids."""
    with self._lock:
      self._stopping = True
      self._wake.notify_all()
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout_s)
      if self._thread.is_alive():
        _log.error("%s: driver thread did not stop within %.1fs", self.name, timeout_s)

  steps = property(lambda self: self._steps, doc="Generate steps run so far.")

  def _held_kv_status(self) -> dict[str, object]:
    if self.held is None:
      return {}
    c = self.held.counters
    return dict(held_kv_rows=self.held.rows, held_kv_entries=len(self.held),
                held_kv_parked=c.parked, held_kv_resumed=c.resumed,
                held_kv_reused_tokens=c.reused_tokens, held_kv_fallbacks=dict(c.fallbacks))

  def check_alive(self) -> None:
    """Raises RolloutError if the driver loop is stopped or crashed."""
    if self._stopping or self._dead:
      raise api.RolloutError(f"{self.name}: driver is not running", ())

  # ================================================================== loop
  @staticmethod
  def _safe_call(callback: Callback, item: Item) -> None:
    try:
      callback(item)
    except Exception:  # pylint: disable=broad-exception-caught
      # A broken consumer must not take the whole server down.
      _log.exception("rollout callback raised")

  def _run(self) -> None:
    try:
      while True:
        with self._lock:
          while not self._stopping and not self._has_work_locked():
            self._wake.wait(timeout=0.5)
          if self._stopping:
            break
          aborts, self._aborts = self._aborts, set()
          switch, self.versions.switch_to = self.versions.switch_to, None
        if switch is not None:
          self._retire_incarnation(switch)
        self._handle_aborts(aborts)
        self.holds.expire(self.store)
        if self.held is not None and len(self.held):
          self.held.drop_unheld(self.holds)  # released holds' entries (abort, timeout, switch)
        self.versions.load_pending()
        firsts = self._admit()
        self._free_unfilled()
        step = self._dispatch(firsts) if self.slots.any_occupied() else None
        # Step t's tokens are read while the device runs step t + 1.
        previous, self._pending_step = self._pending_step, step
        if previous is not None:
          self._record(previous)
        elif step is None:
          # Work is queued but cannot be admitted yet (a version is loading
          # in another thread): wait for its notify instead of spinning.
          with self._lock:
            if not self._stopping and not self._aborts:
              self._wake.wait(timeout=0.05)
    except Exception as e:  # pylint: disable=broad-exception-caught
      _log.exception("%s: driver loop crashed", self.name)
      self._dead = f"{type(e).__name__}: {e}"
      self._fail_all(f"{self.name}: driver crashed: {self._dead}")
      return
    self._fail_all(f"{self.name}: driver stopped")

  def _has_work_locked(self) -> bool:
    if (self._aborts or self.versions.switch_to is not None or self._pending_step is not None
        or self.slots.any_occupied() or self.holds.due_for_check()):
      return True
    return bool(self._queue) and (self.store.admitting or self.store.pending is not None)

  def _fail_all(self, message: str) -> None:
    with self._lock:
      self._stopping = True
      queued = list(self._queue)
      self._queue.clear()
    active = self.slots.active()
    ids = tuple([s.request.request_id for s in active] + [q.request.request_id for q in queued])
    for s in active:
      self.slots.vacate(s.slot)
      self.store.release(s.version)
      self._safe_call(s.callback, api.RolloutError(message, ids))
    for q in queued:
      self._safe_call(q.callback, api.RolloutError(message, ids))
    self.holds.release_all(self.store)
    if self.held is not None:
      self.held.clear()
    if ids:
      _log.warning("%s: failed %d in-flight request(s)", self.name, len(ids))

  def _retire_incarnation(self, incarnation: str | None) -> None:
    """Loop thread: fails the old incarnation's requests, frees its versions."""
    old = self.versions.incarnation
    why = f"{self.name}: run incarnation {old} retired by {incarnation}"
    failed = self.slots.active()
    for s in failed:
      self.slots.vacate(s.slot)
      self._safe_call(s.callback, api.IncarnationMismatchError(why, (s.request.request_id,)))
    with self._lock:
      keep, drop = collections.deque(), []
      for q in self._queue:
        (keep if q.request.incarnation in ("", incarnation) else drop).append(q)
      self._queue = keep
    for q in drop:
      self._safe_call(q.callback, api.IncarnationMismatchError(why, (q.request.request_id,)))
    if old is not None or failed or drop:
      _log.warning("%s: dropped versions and %d request(s) of incarnation %s", self.name,
                   len(failed) + len(drop), old)
    self.versions.reset(incarnation)

  def _handle_aborts(self, aborts: set[str]) -> None:
    if not aborts:
      return
    self.holds.release([a for a in aborts if a in self.holds], self.store)
    with self._lock:
      keep, dropped = collections.deque(), []
      for q in self._queue:
        (dropped if q.request.request_id in aborts else keep).append(q)
      self._queue = keep
    for q in dropped:
      try:
        item = unstarted_result(q.request, "aborted", self.versions.incarnation or "")
      except ValueError as e:  # a malformed resume: it would have been refused anyway
        item = api.RolloutError(f"{self.name}: bad request: {e}", (q.request.request_id,))
      self._safe_call(q.callback, item)
    for s in self.slots.active():
      if s.request.request_id in aborts:
        self._finish(s.slot, "aborted")

  # ------------------------------------------------------------- admission
  def _admit(self) -> list[tuple[int, int, FirstToken]]:
    """Fills free slots from the queue: one batched prefill per version.

    Nothing is read back here: the first tokens are recorded with the next
    step's results, so admission never waits for the device.
    """
    free = self.slots.free_slots()
    by_version: dict[int, list[tuple[Queued, int, Admitted]]] = {}
    resumes: dict[int, list[tuple[Queued, int, Admitted, HeldContext]]] = {}
    while free and self.store.admitting:
      with self._lock:
        if not self._queue:
          break
        q = self._queue.popleft()
      hold = q.request.hold
      continuing = bool(hold) and hold in self.holds  # a next turn (its hold is taken over)
      got = admit(q.request, name=self.name, store=self.store, holds=self.holds,
                  incarnation=self.versions.incarnation, max_seq_len=self.engine.max_seq_len,
                  model_cfg=self.engine.model_cfg, routing_shape=self.engine.routing_shape)
      if not isinstance(got, Admitted):
        if self.held is not None:
          self.held.drop(hold)
        self._safe_call(q.callback, got)
        continue
      entry = None
      if continuing and self.held is not None:
        entry, _ = self.held.resume(hold, got.version, got.context, self.engine.longest_extend)
      if entry is not None:
        resumes.setdefault(got.version, []).append((q, free.pop(0), got, entry))
      else:
        by_version.setdefault(got.version, []).append((q, free.pop(0), got))
    firsts = self._resume_held(resumes)
    for version, entries in by_version.items():
      t0 = time.perf_counter()
      self._state, out, work = self.engine.prefill_insert_batch_async(
          self.store.params(version), version, [a.context for _, _, a in entries],
          [slot for _, slot, _ in entries], self._state)
      self._busy_s += time.perf_counter() - t0
      self.prefill_work.add(work)
      for (q, slot, a), first in zip(entries, out):
        self._resumed_prefill_tokens += len(a.resume)  # prefilled again
        firsts.append((slot, self._occupy(q, slot, a), first))
    return firsts

  def _resume_held(self, resumes: dict[int, list[tuple[Queued, int, Admitted, HeldContext]]]
                   ) -> list[tuple[int, int, FirstToken]]:
    """Next turns whose context is in the held-KV pool: each prefills only its new tokens
    (the last turn's final token and the observation) on top of its held entries."""
    firsts = []
    for version, entries in resumes.items():
      starts = [len(e.tokens) for _, _, _, e in entries]
      t0 = time.perf_counter()
      self._state, out, work = self.engine.extend_insert_batch_async(
          self.store.params(version), version,
          [a.context[n:] for (_, _, a, _), n in zip(entries, starts)], starts,
          [e.pool_row for _, _, _, e in entries], [slot for _, slot, _, _ in entries],
          self._state, self._pool)
      self._busy_s += time.perf_counter() - t0
      self.prefill_work.add(work)
      for (q, slot, a, entry), first in zip(entries, out):
        self.held.release_row(entry)
        firsts.append((slot, self._occupy(q, slot, a), first))
    return firsts

  def _occupy(self, q: Queued, slot: int, a: Admitted) -> int:
    """Puts an admitted request in ``slot``; returns its owner id."""
    n = len(a.context)
    routes = (None if self.engine.routing_shape is None
              else routing.empty_record(self.engine.model_cfg, n + a.budget))
    return self.slots.occupy(Active(
        q.request, q.callback, a.version, slot, context_len=n, budget=a.budget,
        resume=a.resume, stream=q.stream,
        stop_triggers=self.stops.triggers(q.request.stop_strings), routes=routes))

  def _free_unfilled(self) -> None:
    """Deactivates finished slots that admission did not refill (a refilled
    slot's row is simply overwritten: one device call per slot that goes idle)."""
    for slot in self.slots.to_free:
      if self.slots.occupants[slot] is None:
        self._state = self.engine.free_slot(self._state, slot)
    self.slots.to_free.clear()

  # ------------------------------------------------------------------ decode
  def _dispatch(self, firsts: list[tuple[int, int, FirstToken]]) -> DispatchedStep:
    """Launches one decode step (every live version) without waiting for it."""
    params, hint = self.slots.step_inputs(self.store.params)
    now = time.perf_counter()
    self._state, result = self.engine.generate(params, self._state, hint)
    self.slots.advance()
    result.copy_to_host_async()
    self._steps += 1
    self._passes += len(params.live)
    return DispatchedStep(result, self.slots.owner.copy(), firsts, now)

  def _record(self, step: DispatchedStep) -> None:
    """Records a finished step: admitted requests' first tokens, then every
    still-occupied slot's new token; finishes slots that stopped."""
    if step.firsts:
      self._append(*first_tokens(step, self.slots))
    rows, tokens, logprobs = step_tokens(step, self.slots, self.name, self._steps)
    ready = time.perf_counter()
    # Device time: from dispatch (or the end of the previous step, if it was
    # still running) until the results were ready.
    self._busy_s += max(0.0, ready - max(step.dispatched_at, self._device_free_at))
    self._device_free_at = ready
    self._append(rows, tokens, logprobs)
    if self._steps % self.chunk_steps == 0:
      for s in self.slots.active():
        self._flush(s)

  def _append(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
    """Appends one token to each slot in ``rows``; finishes the slots that stopped."""
    if rows.size == 0:
      return
    self.slots.append(rows, tokens, logprobs)
    self._generated += int(rows.size)
    t = self.slots
    eos, full = self.stops.ended(tokens, t.count[rows], t.budget[rows], t.ignore_eos[rows])
    done = eos | full
    for slot, is_eos in zip(rows[done], eos[done]):
      self._finish(int(slot), "eos" if is_eos else "length")
    for slot, token in zip(rows[~done], tokens[~done]):
      s = t.occupants[int(slot)]
      if (s is not None and int(token) in s.stop_triggers and self.stops.completes_stop_string(
          t.tokens[s.slot, :int(t.count[s.slot])], s.request.stop_strings)):
        self._finish(int(slot), "stop")

  def _flush(self, s: Active) -> None:
    chunk = self.slots.unsent(s)
    if chunk is not None:
      self._safe_call(s.callback, chunk)

  def _park(self, s: Active, sampled: np.ndarray) -> None:
    """Keeps a turn's cache entries in the held-KV pool for its hold's next turn.

    The entries of every context token but the last sampled one are in the
    slot (that token's is written by the decode step after it, which may or
    may not have run): the next turn prefills it with the observation.
    """
    context = np.concatenate([np.asarray(s.request.prompt_tokens, np.int32).reshape(-1),
                              s.resume.tokens, sampled])[:-1]
    if self._pool is None:
      self._pool = self.engine.init_held_pool(self.held.rows)
    row = self.held.park(s.request.hold, s.version, context)
    # Issued now: before any later admission can overwrite the slot.
    self._pool = self.engine.park(self._state, self._pool, s.slot, row, len(context))

  def _finish(self, slot: int, reason: str) -> None:
    s = self.slots.occupants[slot]
    self._flush(s)
    tokens, logprobs = self.slots.sampled(slot)
    self.slots.vacate(slot)
    if s.request.hold:
      # Multi-turn: the slot's pin becomes the hold's, so the version stays
      # live while the caller runs a tool and sends the next turn.
      self.holds.take(s.request.hold, s.version, self.store, pin=s.request.keep_version)
      if reason == "stop" and self.held is not None:
        self._park(s, tokens)
    else:
      self.store.release(s.version)
    n = len(tokens)
    routes = None if s.routes is None else s.routes[:s.context_len + n].copy()
    self._safe_call(s.callback, span_result(s.request.request_id, s.resume, tokens, logprobs,
                                            reason, s.version, self.versions.incarnation or "", routes))
