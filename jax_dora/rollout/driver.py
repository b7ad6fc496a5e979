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
from jax_dora.rollout.engine import DoraEngine, MultiVersionParams
from jax_dora.rollout.version_store import LoadDecision, VersionStore
from jax_dora.snapshots import SnapshotReader
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
  """Host-side record of a request occupying a decode slot."""

  request: api.RolloutRequest
  callback: Callback
  version: int
  context_len: int  # prompt + resume prefix (tokens in the cache before new ones)
  budget: int  # new tokens this span may still produce (max_new_tokens and cache)
  stream: bool = True  # send RolloutChunks (False: only the terminal item)
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  sent: int = 0  # tokens already streamed in chunks


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
    except BaseException:
      self.store.abort_load(version)
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
        self._maybe_load_pending()
        self._admit()
        self._free_unfilled()
        if any(s is not None for s in self._slots):
          self._step()
        else:
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
    if self._aborts or self._switch_to is not None or any(s is not None for s in self._slots):
      return True
    return bool(self._queue) and (self.store.admitting or self.store.pending is not None)

  def _fail_all(self, message: str) -> None:
    with self._lock:
      self._stopping = True
      queued = list(self._queue)
      self._queue.clear()
    active = [(i, s) for i, s in enumerate(self._slots) if s is not None]
    ids = tuple([s.request.request_id for _, s in active] + [q.request.request_id for q in queued])
    for i, s in active:
      self._slots[i] = None
      self.store.release(s.version)
      self._safe_call(s.callback, api.RolloutError(message, ids))
    for q in queued:
      self._safe_call(q.callback, api.RolloutError(message, ids))
    if ids:
      _log.warning("%s: failed %d in-flight request(s)", self.name, len(ids))

  def _retire_incarnation(self, incarnation: str | None) -> None:
    """Loop thread: fails the old incarnation's requests, frees its versions."""
    old = self._incarnation
    why = f"{self.name}: run incarnation {old} retired by {incarnation}"
    failed = 0
    for i, s in enumerate(self._slots):
      if s is not None:
        self._slots[i] = None
        self._to_free.add(i)
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
    self.store = VersionStore(self.store.max_versions)
    self.store.peak_loaded = peak
    self._incarnation = incarnation
    if old is not None or failed or drop:
      _log.warning("%s: dropped versions and %d request(s) of incarnation %s", self.name,
                   failed + len(drop), old)
    self._switched.set()

  # ---------------------------------------------------------------- aborts
  def _handle_aborts(self, aborts: set[str]) -> None:
    if not aborts:
      return
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
          incarnation=self._incarnation or ""))
    for i, s in enumerate(self._slots):
      if s is not None and s.request.request_id in aborts:
        self._finish(i, "aborted")

  # ------------------------------------------------------------- admission
  def _admit(self) -> None:
    """Fills free slots from the queue (prefill on the newest version).

    Every prefill is dispatched first and the first tokens are read back in
    one transfer afterwards: one host sync per admission round rather than
    per request (admissions are frequent under long-tailed lengths).
    """
    firsts: list[tuple[int, jax.Array]] = []
    while True:
      free = [i for i, s in enumerate(self._slots) if s is None]
      if not free or not self.store.admitting:
        break
      with self._lock:
        if not self._queue:
          break
        q = self._queue.popleft()
      first = self._admit_one(free[0], q)
      if first is not None:
        firsts.append((free[0], first))
    if firsts:
      values = jax.device_get([f for _, f in firsts])
      for (slot, _), (tok, lp) in zip(firsts, values):
        self._append(slot, int(tok), float(lp))

  def _admit_one(self, slot: int, q: _Queued) -> jax.Array | None:
    """Prefills ``q`` into ``slot``; returns its first (token, logprob) on device."""
    req = q.request
    if req.incarnation and req.incarnation != self._incarnation:
      self._safe_call(q.callback, api.IncarnationMismatchError(
          f"{self.name}: request {req.request_id} is for run incarnation {req.incarnation}, this"
          f" server holds {self._incarnation}", (req.request_id,)))
      return None
    try:
      version = self.store.acquire(req.version)
    except api.VersionUnavailableError as e:
      self._safe_call(q.callback, api.VersionUnavailableError(f"{self.name}: {e}", (req.request_id,)))
      return None
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
    except ValueError as e:
      self.store.release(version)
      self._safe_call(q.callback, api.RolloutError(f"{self.name}: bad request: {e}", (req.request_id,)))
      return None
    if budget <= 0:  # Resumed with nothing left to generate.
      self.store.release(version)
      self._safe_call(q.callback, api.RolloutResult(
          req.request_id, resume, resume_lps, spans, "length", prefill_version=version,
          incarnation=self._incarnation or ""))
      return None
    t0 = time.perf_counter()
    padded, n = self.engine.pad_tokens(context)
    self._state, first = self.engine.prefill_insert_async(
        self.store.params(version), version, padded, n, self._state, slot)
    self._busy_s += time.perf_counter() - t0
    act = _Active(req, q.callback, version, context_len=len(context), budget=budget, stream=q.stream)
    self._slots[slot] = act
    return first

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
  def _append(self, slot: int, token: int, logprob: float) -> None:
    """Records one new token; finishes the slot on EOS / budget."""
    s = self._slots[slot]
    s.tokens.append(token)
    s.logprobs.append(logprob)
    self._generated += 1
    if token in self.stop_ids and not s.request.ignore_eos:
      self._finish(slot, "eos")
    elif len(s.tokens) >= s.budget:
      self._finish(slot, "length")

  def _step(self) -> None:
    live = tuple(sorted({s.version for s in self._slots if s is not None}))
    params = MultiVersionParams({v: self.store.params(v) for v in live}, live)
    t0 = time.perf_counter()
    self._state, result = self.engine.generate(params, self._state)
    result = result.convert_to_numpy()
    self._busy_s += time.perf_counter() - t0
    self._steps += 1
    self._passes += len(live)
    for i, s in enumerate(self._slots):
      if s is None:
        continue
      self._append(i, int(result.data[i, 0]), float(result.logprobs[i, 0]))
    if self._steps % self.chunk_steps == 0:
      for s in self._slots:
        if s is not None:
          self._flush(s)

  def _flush(self, s: _Active) -> None:
    if s.stream and s.sent < len(s.tokens):
      chunk = api.RolloutChunk(
          s.request.request_id,
          np.asarray(s.tokens[s.sent:], np.int32),
          np.asarray(s.logprobs[s.sent:], np.float32),
          s.version,
      )
      s.sent = len(s.tokens)
      self._safe_call(s.callback, chunk)

  def _finish(self, slot: int, reason: str) -> None:
    s = self._slots[slot]
    self._slots[slot] = None
    self._to_free.add(slot)
    self.store.release(s.version)
    self._flush(s)
    resume, resume_lps, spans = _resume_parts(s.request)
    n = len(s.tokens)
    if n:
      spans = spans + (TokenSpan(len(resume), len(resume) + n, s.version),)
    result = api.RolloutResult(
        request_id=s.request.request_id,
        completion_tokens=np.concatenate([resume, np.asarray(s.tokens, np.int32)]),
        logprobs=np.concatenate([resume_lps, np.asarray(s.logprobs, np.float32)]),
        spans=spans,
        finish_reason=reason,
        prefill_version=s.version,
        incarnation=self._incarnation or "",
    )
    self._safe_call(s.callback, result)
