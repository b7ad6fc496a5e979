"""The continuous-batching rollout loop (one per server), shared by both front ends.

Modelled on JetStream's ``orchestrator.Driver`` (prefill -> insert into a free
slot -> generate steps -> detokenize/return, refilling a slot as soon as it
frees), collapsed into one background thread because our models are small and
the interesting part is elsewhere: every slot is pinned to the policy version
that prefilled it, several versions decode side by side
(:class:`~jax_dora.rollout.engine.MultiVersionParams`), and the
:class:`~jax_dora.rollout.version_store.VersionStore` keeps at most
``max_versions`` of them in memory.

Threading: public methods may be called from any thread (the embedded asyncio
client and the gRPC server both do). They only touch queues under a lock and
wake the loop; all device work except parameter loading happens on the driver
thread, and every callback is invoked from it. Parameter loading runs in the
caller of :meth:`RolloutDriver.load_version` (so file I/O never stalls
decoding), except for a *pending* version, which the loop loads itself once
room frees up.

The hot path is asynchronous: an admission round is one batched prefill
(identical prompts of a GRPO group computed once), the decode step for
step ``t+1`` is dispatched before step ``t``'s tokens are read, so the host
records tokens, checks stop conditions and streams chunks while the device
computes; tokens land in per-slot numpy buffers with vectorised updates, so
no Python loop runs per slot per token. The price is one extra decode step
for a slot that just finished (its token is discarded): a step's results
only count for slots whose occupant is still the one it was dispatched for.

Every request ends with exactly one terminal callback: a
:class:`~jax_dora.rollout.api.RolloutResult` (``eos`` / ``length`` /
``aborted``) or a :class:`~jax_dora.rollout.api.RolloutError`. Nothing is
silently dropped, including on :meth:`RolloutDriver.stop` and on a crash of
the loop.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from jax_dora.rollout import api
from jax_dora.model import routing
from jax_dora.rollout.engine import DecodeHint, DoraEngine, FirstToken, MultiVersionParams, PrefillWork
from jax_dora.rollout.version_store import LoadDecision, VersionStore
from jax_dora.snapshots import SnapshotIntegrityError, SnapshotReader
from jax_dora.types import TokenSpan

_log = logging.getLogger(__name__)

Item = api.RolloutChunk | api.RolloutResult | api.RolloutError
Callback = Callable[[Item], None]


@dataclasses.dataclass
class _Queued:
  request: api.RolloutRequest
  callback: Callback
  stream: bool = True


@dataclasses.dataclass
class _Active:
  """Host-side record of a request occupying a decode slot.

  Its tokens live in the driver's per-slot buffers (row ``slot``), which the
  step results update for all slots at once.
  """

  request: api.RolloutRequest
  callback: Callback
  version: int
  slot: int
  context_len: int  # prompt + resume prefix (tokens in the cache before new ones)
  budget: int  # new tokens this span may still produce (max_new_tokens and cache)
  stream: bool = True  # send RolloutChunks (False: only the terminal item)
  sent: int = 0  # tokens already streamed in chunks
  # Multi-turn: token ids that may complete a stop string (checked on the
  # decoded tail only when one of them is sampled), and the strings.
  stop_triggers: frozenset[int] = frozenset()
  # MoE: routes of every position the slot runs, ``[context_len + budget,
  # moe_layers, k]`` (``jax_dora.model.routing``); None for a dense model.
  routes: np.ndarray | None = None


@dataclasses.dataclass
class _Step:
  """A dispatched decode step whose tokens are not read yet.

  ``owners``: the slot occupants' ids at dispatch (-1 = empty); a result row
  counts only while the slot still holds that occupant. ``firsts``: first
  tokens of the requests admitted just before this step, recorded first.
  """

  result: object
  owners: np.ndarray
  firsts: list[tuple[int, int, FirstToken]]  # (slot, owner id, where its first token is)
  dispatched_at: float


def _resume_parts(req: api.RolloutRequest) -> tuple[np.ndarray, np.ndarray, tuple[TokenSpan, ...]]:
  toks = np.zeros((0,), np.int32) if req.resume_tokens is None else np.asarray(req.resume_tokens, np.int32)
  lps = (np.zeros((len(toks),), np.float32) if req.resume_logprobs is None
         else np.asarray(req.resume_logprobs, np.float32))
  if len(lps) != len(toks):
    raise ValueError(f"resume_logprobs has {len(lps)} entries for {len(toks)} resume_tokens")
  return toks, lps, tuple(req.resume_spans)


class RolloutDriver:
  """Owns one engine's slots and runs its continuous-batching loop."""

  def __init__(
      self,
      engine: DoraEngine,
      snapshot_dir: str,
      max_versions: int,
      name: str = "server0",
      *,
      chunk_steps: int = 1,
      stop_on_eos: bool = True,
      load_fn: Callable[[int, str | None], object] | None = None,
      precompile: bool = False,
      hold_timeout_s: float = 600.0,
  ):
    """Starts the loop thread.

    Args:
      engine: The device engine (its slots are this driver's slots).
      snapshot_dir: Where :class:`SnapshotPublisher` writes versions.
      max_versions: Param versions held at once (see ``VersionStore``).
      name: Server name (logs, client ``name``).
      chunk_steps: Stream a chunk every this many generate steps per request
        (1 = every token; larger values cut callback overhead).
      stop_on_eos: False makes every request run to its token budget
        (benchmarks use it so lengths follow the workload, not a random
        policy's EOS rate).
      load_fn: ``(version, incarnation) -> params`` on this engine's
        devices; default reads the snapshot with ``engine.load_params``
        (embedded servers in one process pass a shared loader that reads each
        snapshot once). It must refuse a snapshot of another incarnation.
      precompile: Compile every device call the loop can make (each prefill
        bucket, 1..max_versions live versions) before serving, so no request
        stalls on a compile mid-run (``config.precompile``).
      hold_timeout_s: A version hold (``RolloutRequest.hold``) not taken over
        or released within this long is released (its orchestrator is gone).
    """
    self.engine = engine
    self.name = name
    self.reader = SnapshotReader(snapshot_dir)
    self.store = VersionStore(max_versions)
    self._load_fn = load_fn or (lambda v, inc: engine.load_params(self.reader, v, inc))
    # The run incarnation whose versions this server holds (None: not known
    # yet, or snapshots without one); see ``load_version``.
    self._incarnation: str | None = None
    self._switch_to: str | None = None
    self._switched = threading.Event()
    self.chunk_steps = max(1, int(chunk_steps))
    # Every stop id of the tokenizer ends a completion (HF chat models have
    # several: Llama 3 Instruct's <|eot_id|> besides <|end_of_text|>).
    self.stop_ids = frozenset(int(t) for t in engine.tokenizer.stop_tokens) if stop_on_eos else frozenset()
    self.num_slots = engine.max_concurrent_decodes
    # Per-slot token buffers and stop conditions, updated vectorised per step.
    width = engine.max_seq_len
    self._tok_buf = np.zeros((self.num_slots, width), np.int32)
    self._lp_buf = np.zeros((self.num_slots, width), np.float32)
    self._count = np.zeros((self.num_slots,), np.int64)
    self._budget = np.zeros((self.num_slots,), np.int64)
    self._ignore_eos = np.zeros((self.num_slots,), bool)
    self._owner = np.full((self.num_slots,), -1, np.int64)
    # Where each occupied slot's next decode token is written on the device
    # (context length + steps dispatched since admission, capped at the
    # cache end): the host's half of the engine's static decode programs.
    self._position = np.zeros((self.num_slots,), np.int64)
    self._next_owner = 0
    self._stop_arr = np.asarray(sorted(self.stop_ids), np.int32)
    self._pending_step: _Step | None = None
    self._device_free_at = 0.0
    # Multi-turn: hold id -> (version, monotonic time it was taken). Each hold
    # keeps one store pin on its version.
    self._holds: dict[str, tuple[int, float]] = {}
    # What status() reports, rebuilt by the loop thread on every hold change
    # (status() runs on other threads and must not iterate the dict).
    self._held_versions: tuple[int, ...] = ()
    self.hold_timeout_s = float(hold_timeout_s)
    self._holds_checked = 0.0
    self._stop_triggers: dict[tuple[str, ...], frozenset[int]] = {}
    self.prefill_work = PrefillWork()
    self._resumed_prefill_tokens = 0
    self._integrity_failures = 0  # snapshot loads refused by their checksums

    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._load_lock = threading.Lock()
    self._queue: collections.deque[_Queued] = collections.deque()
    self._aborts: set[str] = set()
    self._slots: list[_Active | None] = [None] * self.num_slots
    self._to_free: set[int] = set()  # finished slots still active on device
    self._stopping = False
    self._dead: str | None = None  # set if the loop crashed
    self._generated = 0
    self._busy_s = 0.0
    self._steps = 0
    self._passes = 0  # sum over steps of live versions (one decode pass each)

    if precompile:
      t0 = time.perf_counter()
      engine.warmup(max_versions)
      _log.info("%s: compiled decode for up to %d versions in %.1fs", name, max_versions,
                time.perf_counter() - t0)
    self._state = engine.init_decode_state()
    self._thread = threading.Thread(target=self._run, name=f"rollout-driver-{name}", daemon=True)
    self._thread.start()

  # ============================================================ public API
  def load_version(self, version: int, incarnation: str | None = None) -> None:
    """Loads snapshot ``version``; returns once loaded or recorded as pending.

    Idempotent. A version older than the newest held one is ignored (new
    requests would not use it).

    ``incarnation`` names the run incarnation the version belongs to (the
    snapshot's metadata must agree). If it differs from the one this server
    holds, every held version is dropped first and the requests still running
    on them fail with :class:`api.IncarnationMismatchError`: version numbers
    of different incarnations name different parameters, so an old "newer"
    version must never shadow the new run's. ``None`` keeps the current
    incarnation, or adopts the snapshot's own on the first load.

    Raises:
      SnapshotNotFoundError / SnapshotCorruptError: from the snapshot reader
        (also for a snapshot of another incarnation than ``incarnation``).
      RolloutError: the driver is stopped.
    """
    version = int(version)
    self.check_alive()
    with self._load_lock:
      if incarnation is None:
        incarnation = self._incarnation
        if incarnation is None:
          incarnation = self.reader.read_metadata(version).get("incarnation")
      if incarnation != self._incarnation:
        self._enter_incarnation(incarnation)
      decision = self.store.begin_load(version)
      if decision is LoadDecision.LOAD:
        self._do_load(version)
      elif decision is LoadDecision.PENDING:
        # Fail fast on a version that does not exist instead of leaving it
        # pending forever.
        if not self.reader.has_version(version):
          self.reader.load(version)  # raises SnapshotNotFoundError with the path
        _log.info("%s: version %d pending (no room among %d held versions: older ones still pinned)", self.name, version,
                  self.store.max_versions)
    with self._lock:
      self._wake.notify_all()

  def _enter_incarnation(self, incarnation: str | None) -> None:
    """Has the loop thread drop every version and request of the old incarnation."""
    with self._lock:
      self._switched.clear()
      self._switch_to = incarnation
      self._wake.notify_all()
    while not self._switched.wait(timeout=0.5):
      self.check_alive()
    _log.info("%s: now serving run incarnation %s", self.name, incarnation)

  @property
  def incarnation(self) -> str | None:
    return self._incarnation

  def submit(self, request: api.RolloutRequest, callback: Callback, *, stream: bool = True) -> None:
    """Queues ``request``; ``callback`` receives its chunks then one terminal item.

    ``stream=False`` skips the chunks (the terminal result carries every
    token): callers that only want the result save a callback per token.
    """
    with self._lock:
      err = None
      if self._stopping or self._dead:
        err = api.RolloutError(
            f"{self.name}: driver is {'stopped' if self._stopping else 'dead: ' + str(self._dead)}",
            (request.request_id,),
        )
      else:
        self._queue.append(_Queued(request, callback, stream))
        self._wake.notify_all()
    if err is not None:
      self._safe_call(callback, err)

  def abort(self, request_ids: list[str]) -> None:
    """Ends those requests (queued or active) with ``finish_reason="aborted"``."""
    with self._lock:
      self._aborts.update(request_ids)
      self._wake.notify_all()

  def status(self) -> api.ServerStatus:
    with self._lock:
      active = [s for s in self._slots if s is not None]
      return api.ServerStatus(
          versions_loaded=self.store.loaded,
          newest_version=self.store.newest,
          active_slots=len(active),
          total_slots=self.num_slots,
          queued_requests=len(self._queue),
          slot_versions=tuple(s.version for s in active),
          incarnation=self._incarnation or "",
          generated_tokens=self._generated,
          busy_time_s=self._busy_s,
          decode_steps=self._steps,
          decode_passes=self._passes,
          prefill_requested_tokens=self.prefill_work.requested_tokens,
          prefill_computed_tokens=self.prefill_work.computed_tokens,
          resumed_prefill_tokens=self._resumed_prefill_tokens,
          held_versions=self._held_versions,
          snapshot_integrity_failures=self._integrity_failures,
      )

  def stop(self, timeout_s: float = 30.0) -> None:
    """Stops the loop; every in-flight request gets a RolloutError with all their ids."""
    with self._lock:
      self._stopping = True
      self._wake.notify_all()
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout_s)
      if self._thread.is_alive():
        _log.error("%s: driver thread did not stop within %.1fs", self.name, timeout_s)

  @property
  def steps(self) -> int:
    """Generate steps run so far."""
    return self._steps

  # ================================================================ loading
  def _do_load(self, version: int) -> None:
    try:
      params = self._load_fn(version, self._incarnation)
    except BaseException as e:
      self.store.abort_load(version)
      if isinstance(e, SnapshotIntegrityError):
        self._integrity_failures += 1
        _log.error("%s: %s", self.name, e)
      raise
    self.store.finish_load(version, params)
    _log.debug("%s: loaded version %d (held: %s)", self.name, version, self.store.loaded)

  def _maybe_load_pending(self) -> None:
    """Loads a pending version once a slot has freed room (driver thread)."""
    if self.store.pending is None or not self._load_lock.acquire(blocking=False):
      return
    try:
      version = self.store.take_pending()
      if version is not None:
        try:
          self._do_load(version)
        except Exception as e:  # pylint: disable=broad-exception-caught
          # Admission resumes on what we have; the orchestrator will offer a
          # newer version soon.
          _log.error("%s: loading pending version %d failed: %s", self.name, version, e)
    finally:
      self._load_lock.release()

  # ================================================================== loop
  def check_alive(self) -> None:
    """Raises RolloutError if the driver loop is stopped or crashed."""
    if self._stopping or self._dead:
      raise api.RolloutError(f"{self.name}: driver is not running", ())

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
          switch, self._switch_to = self._switch_to, None
        if switch is not None:
          self._retire_incarnation(switch)
        self._handle_aborts(aborts)
        self._expire_holds()
        self._maybe_load_pending()
        firsts = self._admit()
        self._free_unfilled()
        step = self._dispatch(firsts) if (self._owner >= 0).any() else None
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
    if (self._aborts or self._switch_to is not None or self._pending_step is not None
        or any(s is not None for s in self._slots)):
      return True
    if self._holds and time.monotonic() - self._holds_checked >= 1.0:
      return True  # a hold may have timed out
    return bool(self._queue) and (self.store.admitting or self.store.pending is not None)

  def _fail_all(self, message: str) -> None:
    with self._lock:
      self._stopping = True
      queued = list(self._queue)
      self._queue.clear()
    active = [(i, s) for i, s in enumerate(self._slots) if s is not None]
    ids = tuple([s.request.request_id for _, s in active] + [q.request.request_id for q in queued])
    for i, s in active:
      self._vacate(i)
      self.store.release(s.version)
      self._safe_call(s.callback, api.RolloutError(message, ids))
    for q in queued:
      self._safe_call(q.callback, api.RolloutError(message, ids))
    self._release_holds(list(self._holds))
    if ids:
      _log.warning("%s: failed %d in-flight request(s)", self.name, len(ids))

  def _retire_incarnation(self, incarnation: str | None) -> None:
    """Loop thread: fails the old incarnation's requests, frees its versions."""
    old = self._incarnation
    why = f"{self.name}: run incarnation {old} retired by {incarnation}"
    failed = 0
    for i, s in enumerate(self._slots):
      if s is not None:
        self._vacate(i)
        failed += 1
        self._safe_call(s.callback, api.IncarnationMismatchError(why, (s.request.request_id,)))
    with self._lock:
      keep, drop = collections.deque(), []
      for q in self._queue:
        (keep if q.request.incarnation in ("", incarnation) else drop).append(q)
      self._queue = keep
    for q in drop:
      self._safe_call(q.callback, api.IncarnationMismatchError(why, (q.request.request_id,)))
    peak = self.store.peak_loaded
    self._holds.clear()  # their pins go with the old store
    self._held_versions = ()
    self.store = VersionStore(self.store.max_versions)
    self.store.peak_loaded = peak
    self._incarnation = incarnation
    if old is not None or failed or drop:
      _log.warning("%s: dropped versions and %d request(s) of incarnation %s", self.name,
                   failed + len(drop), old)
    self._switched.set()

  # ----------------------------------------------------------------- holds
  def _release_holds(self, hold_ids: list[str]) -> None:
    for h in hold_ids:
      held = self._holds.pop(h, None)
      if held is not None:
        self.store.release(held[0])
    self._held_versions = tuple(sorted(v for v, _ in self._holds.values()))

  def _expire_holds(self) -> None:
    """Releases holds older than ``hold_timeout_s`` (checked about once a second)."""
    now = time.monotonic()
    if not self._holds or now - self._holds_checked < 1.0:
      return
    self._holds_checked = now
    old = [h for h, (_, since) in self._holds.items() if now - since > self.hold_timeout_s]
    if old:
      _log.warning("%s: releasing %d version hold(s) not taken over within %.0fs", self.name,
                   len(old), self.hold_timeout_s)
      self._release_holds(old)

  # ------------------------------------------------------------ stop strings
  def _triggers(self, stop_strings: tuple[str, ...]) -> frozenset[int]:
    """Token ids whose text holds the last character of a stop string (cached).

    Only sampling one of these can complete a stop string, so the decoded
    tail is checked for those tokens alone, not every token of every slot.
    """
    if not stop_strings:
      return frozenset()
    key = tuple(stop_strings)
    if key not in self._stop_triggers:
      tok = self.engine.tokenizer
      last = {s[-1] for s in key if s}
      self._stop_triggers[key] = frozenset(
          i for i in range(tok.vocab_size) if last & set(tok.decode([i])))
    return self._stop_triggers[key]

  def _ends_with_stop(self, s: _Active) -> bool:
    """Whether the token just sampled completed one of ``s``'s stop strings."""
    n = int(self._count[s.slot])
    width = max(len(x) for x in s.request.stop_strings) + 1
    tail = self._tok_buf[s.slot, max(0, n - width):n].tolist()
    decode = self.engine.tokenizer.decode
    now, before = decode(tail), decode(tail[:-1])
    return any(x and x in now and x not in before for x in s.request.stop_strings)

  # ---------------------------------------------------------------- aborts
  def _handle_aborts(self, aborts: set[str]) -> None:
    if not aborts:
      return
    self._release_holds([a for a in aborts if a in self._holds])
    with self._lock:
      keep = collections.deque()
      dropped = []
      for q in self._queue:
        (dropped if q.request.request_id in aborts else keep).append(q)
      self._queue = keep
    for q in dropped:
      toks, lps, spans = _resume_parts(q.request)
      self._safe_call(q.callback, api.RolloutResult(
          q.request.request_id, toks, lps, spans, "aborted", prefill_version=-1,
          incarnation=self._incarnation or "", routing=q.request.resume_routing))
    for i, s in enumerate(self._slots):
      if s is not None and s.request.request_id in aborts:
        self._finish(i, "aborted")

  # ------------------------------------------------------------- admission
  def _admit(self) -> list[tuple[int, int, FirstToken]]:
    """Fills free slots from the queue: one batched prefill per version.

    Requests of one round that share a context (a GRPO group's members) are
    prefilled once (``DoraEngine.prefill_insert_batch_async``). Nothing is
    read back here: the first tokens are recorded with the next step's
    results, so admission never waits for the device.
    """
    free = [i for i, s in enumerate(self._slots) if s is None]
    by_version: dict[int, list[tuple[_Queued, int, np.ndarray, int]]] = {}
    while free and self.store.admitting:
      with self._lock:
        if not self._queue:
          break
        q = self._queue.popleft()
      prepared = self._prepare(q)
      if prepared is not None:
        version, context, budget = prepared
        by_version.setdefault(version, []).append((q, free.pop(0), context, budget))
    firsts = []
    for version, entries in by_version.items():
      t0 = time.perf_counter()
      self._state, out, work = self.engine.prefill_insert_batch_async(
          self.store.params(version), version, [e[2] for e in entries], [e[1] for e in entries],
          self._state)
      self._busy_s += time.perf_counter() - t0
      self.prefill_work.add(work)
      for (q, slot, context, budget), first in zip(entries, out):
        routes = (None if self.engine.routing_shape is None
                  else routing.empty_record(self.engine.model_cfg, len(context) + budget))
        owner = self._occupy(slot, _Active(q.request, q.callback, version, slot,
                                           context_len=len(context), budget=budget,
                                           stream=q.stream,
                                           stop_triggers=self._triggers(q.request.stop_strings),
                                           routes=routes))
        self._resumed_prefill_tokens += len(context) - len(q.request.prompt_tokens)
        firsts.append((slot, owner, first))
    return firsts

  def _prepare(self, q: _Queued) -> tuple[int, np.ndarray, int] | None:
    """Validates ``q`` and pins its version: ``(version, context, budget)``, or
    ``None`` after answering the request (refused, or nothing left to do)."""
    req = q.request
    if req.incarnation and req.incarnation != self._incarnation:
      self._safe_call(q.callback, api.IncarnationMismatchError(
          f"{self.name}: request {req.request_id} is for run incarnation {req.incarnation}, this"
          f" server holds {self._incarnation}", (req.request_id,)))
      return None
    held = self._holds.get(req.hold) if req.hold else None
    want = req.version if req.version is not None or held is None else held[0]
    try:
      version = self.store.acquire(want)
    except api.VersionUnavailableError as e:
      self._safe_call(q.callback, api.VersionUnavailableError(f"{self.name}: {e}", (req.request_id,)))
      return None
    if held is not None:
      self._release_holds([req.hold])  # the new turn's own pin replaces the hold's
    try:
      resume, resume_lps, spans = _resume_parts(req)
      prompt = np.asarray(req.prompt_tokens, np.int32).reshape(-1)
      context = np.concatenate([prompt, resume])
      budget = min(int(req.max_new_tokens) - len(resume), self.engine.max_seq_len - len(context))
      if len(prompt) == 0:
        raise ValueError("empty prompt_tokens")
      if len(context) >= self.engine.max_seq_len:
        raise ValueError(
            f"prompt + resume = {len(context)} tokens leaves no room in max_seq_len="
            f"{self.engine.max_seq_len}")
      self._check_resume_routing(req, len(context))
    except ValueError as e:
      self.store.release(version)
      self._safe_call(q.callback, api.RolloutError(f"{self.name}: bad request: {e}", (req.request_id,)))
      return None
    if budget <= 0:  # Resumed with nothing left to generate.
      self.store.release(version)
      self._safe_call(q.callback, api.RolloutResult(
          req.request_id, resume, resume_lps, spans, "length", prefill_version=version,
          incarnation=self._incarnation or "", routing=req.resume_routing))
      return None
    return version, context, budget

  def _check_resume_routing(self, req: api.RolloutRequest, context_len: int) -> None:
    """A request's recorded routes must be this model's, one row per context token."""
    rec = req.resume_routing
    if rec is None:
      return
    shape = self.engine.routing_shape
    if shape is None:
      raise ValueError("resume_routing sent to a dense model's server")
    want = (context_len,) + shape
    dtype = routing.routing_dtype(self.engine.model_cfg.num_experts)
    if tuple(np.shape(rec)) != want or np.asarray(rec).dtype != dtype:
      raise ValueError(f"resume_routing is {np.asarray(rec).dtype}{list(np.shape(rec))}, this"
                       f" model records {dtype}{list(want)} (prompt + resume tokens, MoE layers, k)")

  def _occupy(self, slot: int, act: _Active) -> int:
    self._next_owner += 1
    self._slots[slot] = act
    self._owner[slot] = self._next_owner
    self._count[slot] = 0
    self._position[slot] = act.context_len
    self._budget[slot] = act.budget
    self._ignore_eos[slot] = bool(act.request.ignore_eos)
    return self._next_owner

  def _vacate(self, slot: int) -> None:
    self._slots[slot] = None
    self._owner[slot] = -1
    self._to_free.add(slot)

  def _free_unfilled(self) -> None:
    """Deactivates finished slots that admission did not refill.

    A refilled slot needs nothing (``insert`` overwrites the row), so this
    costs one device call only per slot that actually goes idle.
    """
    for slot in self._to_free:
      if self._slots[slot] is None:
        self._state = self.engine.free_slot(self._state, slot)
    self._to_free.clear()

  # ------------------------------------------------------------------ decode
  def _dispatch(self, firsts: list[tuple[int, int, FirstToken]]) -> _Step:
    """Launches one decode step (every live version) without waiting for it."""
    occupied = self._owner >= 0
    versions = collections.Counter(s.version for s in self._slots if s is not None)
    live = tuple(sorted(versions))
    params = MultiVersionParams({v: self.store.params(v) for v in live}, live)
    hint = DecodeHint(int(self._position[occupied].max()), dict(versions))
    now = time.perf_counter()
    self._state, result = self.engine.generate(params, self._state, hint)
    self._position[occupied] = np.minimum(self._position[occupied] + 1, self.engine.max_seq_len)
    result.copy_to_host_async()
    self._steps += 1
    self._passes += len(live)
    return _Step(result, self._owner.copy(), firsts, now)

  def _record(self, step: _Step) -> None:
    """Records a finished step: admitted requests' first tokens, then every
    still-occupied slot's new token; finishes slots on a stop token or budget."""
    if step.firsts:
      arrays = {id(a): a for _, _, f in step.firsts for a in (f.values, f.routes)
                if a is not None}
      host = dict(zip(arrays, jax.device_get(list(arrays.values()))))
      slots = np.asarray([f[0] for f in step.firsts])
      keep = self._owner[slots] == np.asarray([f[1] for f in step.firsts])
      values = np.stack([host[id(f.values)][f.row] for _, _, f in step.firsts])
      for (slot, _, f), kept in zip(step.firsts, keep):
        s = self._slots[slot]
        if kept and f.routes is not None:
          # The context's routes: recorded ones (a resume, a tool turn) stay.
          fresh = host[id(f.routes)][f.context][:s.context_len]
          s.routes[:s.context_len] = routing.keep_recorded(s.request.resume_routing, fresh)
      self._append(slots[keep], values[keep, 0].astype(np.int32), values[keep, 1])
    data = np.asarray(step.result.data)
    logprobs = np.asarray(step.result.logprobs)[:, 0]
    if bool(np.asarray(step.result.hint_violated)):
      # The static program read fewer cache entries (or rows) than a slot
      # needed: its tokens are wrong. Crash loudly (every open request fails
      # and is re-issued) rather than stream them.
      raise RuntimeError(f"{self.name}: decode step {self._steps} ran with a wrong DecodeHint"
                         " (host-side slot positions or version counts disagree with the device)")
    ready = time.perf_counter()
    # Device time: from dispatch (or the end of the previous step, if it was
    # still running) until the results were ready.
    self._busy_s += max(0.0, ready - max(step.dispatched_at, self._device_free_at))
    self._device_free_at = ready
    rows = np.flatnonzero((step.owners >= 0) & (step.owners == self._owner))
    if step.result.routes is not None:
      # The step ran each row's previous token: its routes go to that position.
      routes = np.asarray(step.result.routes)
      for row in rows:
        s = self._slots[row]
        s.routes[s.context_len + int(self._count[row]) - 1] = routes[row]
    self._append(rows, data[rows, 0], logprobs[rows])
    if self._steps % self.chunk_steps == 0:
      for s in self._slots:
        if s is not None:
          self._flush(s)

  def _append(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
    """Appends one token to each slot in ``rows``; finishes slots on EOS / budget."""
    if rows.size == 0:
      return
    n = self._count[rows]
    self._tok_buf[rows, n] = tokens
    self._lp_buf[rows, n] = logprobs
    self._count[rows] = n + 1
    self._generated += int(rows.size)
    eos = np.isin(tokens, self._stop_arr) & ~self._ignore_eos[rows]
    full = self._count[rows] >= self._budget[rows]
    for slot, is_eos in zip(rows[eos | full], eos[eos | full]):
      self._finish(int(slot), "eos" if is_eos else "length")
    for slot, token in zip(rows[~(eos | full)], tokens[~(eos | full)]):
      s = self._slots[int(slot)]
      if s is not None and s.stop_triggers and int(token) in s.stop_triggers and (
          self._ends_with_stop(s)):
        self._finish(int(slot), "stop")

  def _tokens(self, s: _Active) -> tuple[np.ndarray, np.ndarray]:
    n = int(self._count[s.slot])
    return self._tok_buf[s.slot, :n].copy(), self._lp_buf[s.slot, :n].copy()

  def _flush(self, s: _Active) -> None:
    n = int(self._count[s.slot])
    if s.stream and s.sent < n:
      chunk = api.RolloutChunk(
          s.request.request_id,
          self._tok_buf[s.slot, s.sent:n].copy(),
          self._lp_buf[s.slot, s.sent:n].copy(),
          s.version,
      )
      s.sent = n
      self._safe_call(s.callback, chunk)

  def _finish(self, slot: int, reason: str) -> None:
    s = self._slots[slot]
    self._flush(s)
    tokens, logprobs = self._tokens(s)
    self._vacate(slot)
    if s.request.hold:
      # Multi-turn: the slot's pin becomes the hold's, so the version stays
      # live while the caller runs a tool and sends the next turn.
      self._release_holds([s.request.hold])
      self._holds[s.request.hold] = (s.version, time.monotonic())
      self._held_versions = tuple(sorted(v for v, _ in self._holds.values()))
    else:
      self.store.release(s.version)
    resume, resume_lps, spans = _resume_parts(s.request)
    n = len(tokens)
    if n:
      spans = spans + (TokenSpan(len(resume), len(resume) + n, s.version),)
    result = api.RolloutResult(
        request_id=s.request.request_id,
        completion_tokens=np.concatenate([resume, tokens]),
        logprobs=np.concatenate([resume_lps, logprobs]),
        spans=spans,
        finish_reason=reason,
        prefill_version=s.version,
        incarnation=self._incarnation or "",
        routing=None if s.routes is None else s.routes[:s.context_len + n].copy(),
    )
    self._safe_call(s.callback, result)
