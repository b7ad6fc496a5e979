"""Routes rollout requests to servers and survives servers that die, hang or restart.

A request that fails because its server crashed is re-issued with the same
``(sample_id, member)`` key, so a crash never loses a sample and never
produces two trajectories for one key (the failed attempt never returned a
result: its stream is cancelled before the key is re-issued). Every re-issue
is reported to the caller's ``on_reissue`` hook so the integrity ledger can
account for it.

Liveness is judged by progress, not by a deadline per request (a long
generation is not a failure):

* A monitor task per server probes it every ``health_interval_s``
  (``client.health()``; ``client.status()`` for clients without one). A
  server without a successful probe for ``unhealthy_after_s`` (a SIGSTOPped
  process keeps its TCP connection but answers nothing), or with requests in
  flight whose ``generated_tokens`` has not moved for ``stall_timeout_s``, is
  declared *down*: the streams of its in-flight requests are cancelled, and
  their ``run`` calls re-issue them elsewhere.
* A request that fails (server killed, connection lost, in-band error) makes
  its server *suspect*: no new request goes to it until a health check
  passes. The request is re-issued at once on another admitted server, or on
  the same one after an exponential backoff (with jitter) when it is the only
  one. With no admitted server at all, requests wait for one to come back
  (``no_server_grace_s`` at most) instead of failing.
* A suspect or down server is probed (with backoff while it stays down). When
  it answers again it is re-admitted, after loading the newest broadcast
  version (:meth:`Dispatcher._load_current`).
* Restarts are told apart from blips by the server's Health ``instance`` id
  (one per server process): an instance change, or a stall, counts against
  ``max_restarts``; a server that exceeds it is retired for good. A blip
  (same process back after a timeout or a failed request, e.g. a SIGSTOP
  followed by SIGCONT, or a network hiccup) does not use the budget.
  Clients with ``restartable = False`` (the embedded in-process servers,
  whose stopped driver never comes back) are retired on the first health
  check that fails with an error.

``NoLiveServersError`` is raised only when every server is retired, or when
none has been admitted for ``no_server_grace_s``. A request that fails
``max_request_attempts`` times raises its last :class:`RolloutError`.
``abort_all`` also ends requests waiting here for a server (they return
'aborted', as a request still queued on a server would).

The monitors start on the first ``run``/``broadcast_version``/``abort_all``
on a running loop; ``await dispatcher.close()`` stops them (do it before
closing the clients, or the monitors probe closed clients).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from jax_dora.orchestrator.group_affinity import GroupAffinity
from jax_dora.rollout.api import (
    ResumeParts,
    RolloutClient,
    RolloutError,
    RolloutRequest,
    RolloutResult,
    VersionUnavailableError,
)
from jax_dora.types import Prompt, Trajectory

log = logging.getLogger(__name__)

# Requests with this tag (held-out evaluation) are never aborted by abort_all.
EVAL_TAG = "eval"

_T = TypeVar("_T")

# Server states. Only UP servers get requests (``live_clients``).
UP = "up"
SUSPECT = "suspect"  # a request failed on it: not used until a health check passes
DOWN = "down"  # declared dead (health or progress): its requests were cancelled
RETIRED = "retired"  # for good (restart budget spent, or cannot come back)


class NoLiveServersError(RuntimeError):
  """Every rollout server has failed; the run cannot make progress."""


@dataclasses.dataclass(eq=False)
class _ServerSlot:
  client: RolloutClient
  in_flight: int = 0
  state: str = UP
  why: str = ""  # reason for the current state
  since: float = 0.0  # loop time the state was entered
  restarts: int = 0  # process restarts seen (new Health instance) + stalls
  blips: int = 0  # suspect/down periods that ended with the same process back
  instance: str | None = None  # Health instance id last seen
  charged: bool = False  # this outage already used the restart budget (restart/stall)
  last_ok: float = 0.0  # loop time of the last successful probe
  last_tokens: int | None = None  # generated_tokens at the last probe
  last_progress: float = 0.0  # loop time generated_tokens last moved (or idle)
  backoff_n: int = 0  # failed re-admission attempts in a row
  # Resolved (and replaced) when the server is declared down: every request
  # and control call on it waits on this too, so they end promptly.
  down: asyncio.Future | None = None
  poke: asyncio.Event | None = None  # wakes the monitor (a request failed)
  task: asyncio.Task | None = None  # the monitor
  total_slots: int | None = None  # decode slots, from its Health answer (None: not known)

  @property
  def alive(self) -> bool:
    return self.state == UP

  @property
  def has_room(self) -> bool:
    """A free decode slot (as far as the dispatcher knows): a new request starts at once."""
    return self.total_slots is None or self.in_flight < self.total_slots


class Dispatcher:
  """Least-loaded routing over rollout clients, with health checks and failover.

  Args:
    clients: The rollout servers.
    on_reissue: ``(sample_id, member, why)``, called before every re-issue.
    max_restarts: Restarts (a new process at the same address) and stalls a
      server may have; one more retires it for good.
    health_interval_s: Seconds between health probes of an admitted server.
    health_timeout_s: Deadline of one probe.
    unhealthy_after_s: An admitted (or suspect) server with no successful
      probe for this long is declared down and its requests re-issued.
    stall_timeout_s: A server with requests in flight whose generated-token
      count does not move for this long is declared down (0 = no check).
    retry_backoff_s / retry_backoff_max_s: Backoff before a failed request is
      retried on the server it failed on (doubling per attempt, jittered);
      re-issues on another server are immediate.
    readmit_backoff_max_s: Longest interval between probes of a down server
      (they start at ``health_interval_s`` and double).
    no_server_grace_s: With no admitted server for this long, ``run`` raises
      :class:`NoLiveServersError` even if some are not retired yet.
    max_request_attempts: Failed attempts of one request before its error is
      raised (0 = unlimited).
    seed: For the backoff jitter.
  """

  def __init__(
      self,
      clients: Sequence[RolloutClient],
      on_reissue: Callable[[int, int, str], None] | None = None,
      *,
      max_restarts: int = 3,
      health_interval_s: float = 5.0,
      health_timeout_s: float = 10.0,
      unhealthy_after_s: float = 30.0,
      stall_timeout_s: float = 300.0,
      retry_backoff_s: float = 0.5,
      retry_backoff_max_s: float = 30.0,
      readmit_backoff_max_s: float = 30.0,
      no_server_grace_s: float = 1800.0,
      max_request_attempts: int = 16,
      seed: int | None = None,
      incarnation: str | None = None,
  ):
    if not clients:
      raise ValueError("Dispatcher needs at least one rollout client")
    if min(health_interval_s, health_timeout_s, unhealthy_after_s) <= 0:
      raise ValueError("health_interval_s, health_timeout_s and unhealthy_after_s must be > 0")
    if max_restarts < 0 or stall_timeout_s < 0 or retry_backoff_s < 0:
      raise ValueError("max_restarts, stall_timeout_s and retry_backoff_s must be >= 0")
    self._servers = [_ServerSlot(c) for c in clients]
    self._on_reissue = on_reissue
    self._max_restarts = int(max_restarts)
    self._interval = float(health_interval_s)
    self._health_timeout = float(health_timeout_s)
    self._unhealthy_after = float(unhealthy_after_s)
    self._stall_timeout = float(stall_timeout_s)
    self._backoff = float(retry_backoff_s)
    self._backoff_max = float(retry_backoff_max_s)
    self._readmit_max = max(float(readmit_backoff_max_s), self._interval)
    self._grace = float(no_server_grace_s)
    self._max_attempts = int(max_request_attempts)
    self._rng = random.Random(seed)
    self._ids = itertools.count()
    self._active: dict[str, _ServerSlot] = {}
    # A GRPO group's members prefer the server its first member went to.
    self._affinity: GroupAffinity[_ServerSlot] = GroupAffinity()
    # Newest version broadcast: what a (re-)admitted server must hold.
    self._version: int | None = None
    # The run incarnation every load and request names (jax_dora.snapshots).
    self.incarnation = incarnation
    self._abort_gen = 0  # bumped by abort_all (aborts requests waiting here too)
    self._loop: asyncio.AbstractEventLoop | None = None
    self._changed: asyncio.Future | None = None  # resolved on state changes
    self._none_up_since: float | None = None
    self._outage_logged: float | None = None
    self._closed = False

  # ------------------------------------------------------------ inspection
  @property
  def live_clients(self) -> list[RolloutClient]:
    """Clients of the admitted servers (the ones that get requests)."""
    return [s.client for s in self._servers if s.state == UP]

  @property
  def in_flight(self) -> int:
    return sum(s.in_flight for s in self._servers)

  @property
  def version(self) -> int | None:
    """Newest version broadcast (loaded by every server before admission)."""
    return self._version

  def server_states(self) -> list[dict[str, Any]]:
    """One dict per server: name, state, why, restarts, blips, in_flight, instance, total_slots."""
    return [
        {"name": s.client.name, "state": s.state, "why": s.why, "restarts": s.restarts,
         "blips": s.blips, "in_flight": s.in_flight, "instance": s.instance,
         "total_slots": s.total_slots}
        for s in self._servers
    ]

  def group_affinity_counts(self) -> dict[str, int]:
    """Members kept on their group's server and members that fell back (cumulative)."""
    return self._affinity.counts()

  def _pick(self, avoid: _ServerSlot | None = None,
            group: tuple[str, int] | None = None) -> _ServerSlot | None:
    """The group's home server while it is admitted, not ``avoid`` and has a free slot;
    otherwise the least-loaded admitted server (another than ``avoid`` if possible)."""
    home = self._affinity.home(group)
    if home is not None and home.alive and home is not avoid and home.has_room:
      return home
    up = [s for s in self._servers if s.state == UP]
    pool = [s for s in up if s is not avoid] or up
    return min(pool, key=lambda s: s.in_flight) if pool else None

  def _summary(self) -> str:
    return "; ".join(
        f"{s.client.name}: {s.state}" + (f" ({s.why})" if s.why else "")
        + f", restarts {s.restarts}/{self._max_restarts}"
        for s in self._servers
    )

  # --------------------------------------------------------------- monitor
  def _ensure_monitor(self) -> None:
    """Starts the per-server monitors on the running loop (once per loop)."""
    loop = asyncio.get_running_loop()
    if self._loop is loop and not self._closed:
      return
    self._loop, self._closed = loop, False
    self._changed = loop.create_future()
    now = loop.time()
    for s in self._servers:
      s.down = loop.create_future()
      s.poke = asyncio.Event()
      s.last_ok = s.last_progress = s.since = now
      if s.state != RETIRED:
        s.task = loop.create_task(self._monitor(s), name=f"health-{s.client.name}")
    if not any(s.state == UP for s in self._servers):
      self._none_up_since = now

  async def close(self) -> None:
    """Stops the monitors (call before closing the clients). Idempotent."""
    self._closed = True
    tasks = [s.task for s in self._servers if s.task is not None]
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in self._servers:
      s.task = None

  aclose = close

  def _notify(self) -> None:
    if self._changed is not None and not self._changed.done():
      self._changed.set_result(None)
    if self._loop is not None:
      self._changed = self._loop.create_future()

  async def _wait_change(self, timeout: float) -> None:
    """Waits up to ``timeout`` for a server state change or an abort."""
    fut = self._changed
    if fut is None:
      await asyncio.sleep(timeout)
      return
    try:
      await asyncio.wait_for(asyncio.shield(fut), max(0.0, timeout))
    except TimeoutError:
      pass

  def _set_state(self, s: _ServerSlot, state: str, why: str = "") -> None:
    s.state, s.why = state, why
    s.since = self._loop.time() if self._loop is not None else time.monotonic()
    if any(x.state == UP for x in self._servers):
      self._none_up_since = None
    elif self._none_up_since is None:
      self._none_up_since = s.since
    self._notify()

  def _suspect(self, s: _ServerSlot, err: BaseException) -> None:
    """A request or load failed on ``s``: stop routing to it until it is checked."""
    if s.state != UP:
      return
    self._set_state(s, SUSPECT, str(err))
    log.warning(
        "rollout server %s: %s; no new requests go to it until a health check passes",
        s.client.name, err,
    )
    if s.poke is not None:
      s.poke.set()

  def _take_down(self, s: _ServerSlot, why: str) -> None:
    """Declares ``s`` down: its in-flight requests and calls end now."""
    if s.state in (DOWN, RETIRED):
      return
    self._set_state(s, DOWN, why)
    log.warning(
        "rollout server %s is down (%s); its %d in-flight request(s) will be re-issued"
        " (restarts so far %d of max %d)",
        s.client.name, why, s.in_flight, s.restarts, self._max_restarts,
    )
    if s.down is not None and not s.down.done():
      s.down.set_result(why)
    s.down = self._loop.create_future()

  def _retire(self, s: _ServerSlot, why: str) -> None:
    if s.state == RETIRED:
      return
    self._set_state(s, RETIRED, why)
    if s.down is not None and not s.down.done():
      s.down.set_result(why)
    left = sum(x.state != RETIRED for x in self._servers)
    log.error(
        "rollout server %s retired for good: %s (restarts %d, max %d); %d of %d server(s) left",
        s.client.name, why, s.restarts, self._max_restarts, left, len(self._servers),
    )

  async def _probe(self, s: _ServerSlot) -> tuple[dict | None, BaseException | None]:
    """One health check: ``(info, None)`` or ``(None, error)``."""
    health = getattr(s.client, "health", None)
    try:
      if health is not None:
        info = await asyncio.wait_for(
            health(timeout_s=self._health_timeout), self._health_timeout + 1.0
        )
      else:
        st = await asyncio.wait_for(s.client.status(), self._health_timeout)
        info = {"generated_tokens": st.generated_tokens}
      return dict(info or {}), None
    except asyncio.CancelledError:
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      return None, e

  def _readmit_delay(self, s: _ServerSlot) -> float:
    s.backoff_n += 1
    d = min(self._readmit_max, self._interval * 2 ** min(s.backoff_n, 16))
    return d * self._rng.uniform(0.5, 1.0)

  async def _monitor(self, s: _ServerSlot) -> None:
    """Probes ``s`` until it is retired (or the dispatcher closes)."""
    loop = asyncio.get_running_loop()
    delay = 0.0  # first probe at once: learns the server's instance id
    while s.state != RETIRED:
      if delay > 0:
        try:
          await asyncio.wait_for(s.poke.wait(), delay)
        except TimeoutError:
          pass
      s.poke.clear()
      try:
        info, err = await self._probe(s)
        if s.state == RETIRED:
          break
        if err is None:
          s.last_ok = loop.time()
          delay = await self._probe_ok(s, info)
        else:
          delay = self._probe_failed(s, err)
      except asyncio.CancelledError:
        raise
      except Exception:  # pylint: disable=broad-exception-caught
        log.exception("health monitor of %s failed; retrying", s.client.name)
        delay = self._interval

  async def _probe_ok(self, s: _ServerSlot, info: dict) -> float:
    now = self._loop.time()
    inst = info.get("instance")
    if inst is not None:
      if s.instance is not None and inst != s.instance:
        s.restarts += 1
        s.charged = True
        log.warning(
            "rollout server %s restarted (new process at the same address): restart %d of max %d",
            s.client.name, s.restarts, self._max_restarts,
        )
        self._take_down(s, "restarted")  # its old streams died with the old process
        if s.restarts > self._max_restarts:
          self._retire(s, f"restarted; {s.restarts} restart(s)/stall(s) exceed"
                          f" max_restarts={self._max_restarts}")
          return 0.0
      s.instance = inst
    if info.get("total_slots"):
      s.total_slots = int(info["total_slots"])
    if s.state == UP:
      tokens = info.get("generated_tokens")
      if tokens is not None:
        if s.in_flight == 0 or s.last_tokens is None or tokens != s.last_tokens:
          s.last_progress = now
        s.last_tokens = tokens
        stalled = now - s.last_progress
        if self._stall_timeout > 0 and s.in_flight and stalled >= self._stall_timeout:
          s.restarts += 1  # a wedged server is no blip: stalls use the budget
          s.charged = True
          why = f"no token generated for {stalled:.0f}s with {s.in_flight} request(s) in flight"
          self._take_down(s, why)
          if s.restarts > self._max_restarts:
            self._retire(s, f"{why}; {s.restarts} restart(s)/stall(s) exceed"
                            f" max_restarts={self._max_restarts}")
            return 0.0
          return self._interval
      return self._interval
    # Suspect or down, and answering: re-admit once it holds the current version.
    try:
      await self._load_current(s)
    except asyncio.CancelledError:
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      log.warning(
          "rollout server %s answers but could not load version %s: %s; will retry",
          s.client.name, self._version, e,
      )
      return self._readmit_delay(s)
    if s.state == RETIRED:
      return 0.0
    was, why, away = s.state, s.why, self._loop.time() - s.since
    if s.charged:
      kind = f"{s.restarts} of max {self._max_restarts} restarts/stalls used"
    else:
      s.blips += 1
      kind = (f"same process, blip {s.blips} (restart budget untouched:"
              f" {s.restarts} of max {self._max_restarts} used)")
    s.charged, s.backoff_n = False, 0
    s.last_tokens, s.last_progress = None, self._loop.time()
    self._set_state(s, UP)
    log.warning(
        "rollout server %s re-admitted at version %s after %.1fs %s (%s): %s",
        s.client.name, self._version, away, was, why, kind,
    )
    return self._interval

  def _probe_failed(self, s: _ServerSlot, err: BaseException) -> float:
    if not getattr(s.client, "restartable", True) and not isinstance(err, TimeoutError):
      self._retire(s, f"health check failed and it cannot be restarted: {err}")
      return 0.0
    if s.state in (UP, SUSPECT):
      quiet = self._loop.time() - s.last_ok
      if quiet >= self._unhealthy_after:
        self._take_down(s, f"no successful health check for {quiet:.1f}s: {err}")
        return self._readmit_delay(s)
      return self._interval
    return self._readmit_delay(s)

  # ------------------------------------------------------------- versions
  async def _load_current(self, s: _ServerSlot) -> None:
    """Makes ``s`` load the newest broadcast version (the one place that loads).

    Loops if a newer version is broadcast meanwhile, so a server is never
    (re-)admitted behind the others.
    """
    while self._version is not None:
      v = self._version
      await s.client.load_version(v, self.incarnation)
      if self._version == v:
        return

  async def _guarded(self, s: _ServerSlot, aw: Awaitable[_T]) -> _T:
    """Awaits ``aw`` unless ``s`` is declared down first (then RolloutError)."""
    task = asyncio.ensure_future(aw)
    down = s.down
    try:
      if down is not None:
        await asyncio.wait((task, down), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
          task.cancel()
          await asyncio.wait((task,))
          if task.cancelled():
            raise RolloutError(
                f"rollout server {s.client.name} declared down: {down.result()}"
            )
      return await task
    finally:
      if not task.done():
        task.cancel()

  async def broadcast_version(self, version: int) -> None:
    """Tells every admitted server to load ``version``.

    A server that fails to load it is suspended until its monitor has made it
    load the newest version (not retired). Raises NoLiveServersError only if
    every server is retired.
    """
    self._ensure_monitor()
    if self._version is None or int(version) > self._version:
      self._version = int(version)

    async def load(s: _ServerSlot):
      try:
        await self._guarded(s, self._load_current(s))
      except RolloutError as e:
        self._suspect(s, e)

    await asyncio.gather(*(load(s) for s in self._servers if s.state == UP))
    if all(s.state == RETIRED for s in self._servers):
      raise NoLiveServersError(
          f"all rollout servers have failed; none can load version {version}: {self._summary()}"
      )

  async def abort_all(self) -> None:
    """Aborts every training request in flight (their results come back 'aborted').

    Requests waiting here for a server (or for a retry) return 'aborted' too.
    Held-out evaluation requests (tag ``"eval"``) are never aborted: a publish
    that interrupts training rollouts must not truncate what eval scores.
    """
    self._ensure_monitor()
    self._abort_gen += 1
    self._notify()
    by_server: dict[int, tuple[_ServerSlot, list[str]]] = {}
    for rid, s in list(self._active.items()):
      if rid.startswith(f"{EVAL_TAG}-"):
        continue
      by_server.setdefault(id(s), (s, []))[1].append(rid)
    await asyncio.gather(
        *(self._guarded(s, s.client.abort(ids)) for s, ids in by_server.values()
          if s.state in (UP, SUSPECT)),
        return_exceptions=True,
    )

  # --------------------------------------------------------------- routing
  async def _acquire(self, abort_gen: int | None, avoid: _ServerSlot | None,
                     group: tuple[str, int] | None = None) -> _ServerSlot | None:
    """An admitted server (the group's home when it has room); waits while there is
    none. None once aborted (``abort_gen=None``: a request ``abort_all`` never aborts)."""
    while True:
      if abort_gen is not None and self._abort_gen != abort_gen:
        return None
      s = self._pick(avoid, group)
      if s is not None:
        return s
      if all(x.state == RETIRED for x in self._servers):
        raise NoLiveServersError(f"all rollout servers have failed: {self._summary()}")
      now = self._loop.time()
      since = now if self._none_up_since is None else self._none_up_since
      left = self._grace - (now - since)
      if left <= 0:
        raise NoLiveServersError(
            f"no rollout server came back within {self._grace:.0f}s: {self._summary()}"
        )
      if self._outage_logged != self._none_up_since:  # once per outage
        self._outage_logged = self._none_up_since
        log.warning("no live rollout server; requests wait up to %.0fs for one: %s", left,
                    self._summary())
      await self._wait_change(min(left, 5.0))

  def _retry_delay(self, attempts: int) -> float:
    d = min(self._backoff_max, self._backoff * 2 ** min(attempts - 1, 16))
    return d * self._rng.uniform(0.5, 1.0)

  def _aborted(self, rid: str, resume: ResumeParts | None) -> RolloutResult:
    """The result of a request aborted before it reached a server (as the driver's).

    It carries the run's incarnation: without it the orchestrator would take
    it for another run's result, discard it and re-issue the sample.
    """
    if resume is None:
      resume = ResumeParts(np.zeros((0,), np.int32), np.zeros((0,), np.float32))
    return RolloutResult(rid, resume.tokens, resume.logprobs, tuple(resume.spans), "aborted",
                         prefill_version=-1, incarnation=self.incarnation or "",
                         routing=resume.routing)

  async def run(
      self,
      prompt: Prompt,
      prompt_tokens: np.ndarray,
      member: int,
      max_new_tokens: int,
      *,
      version: int | None = None,
      resume: Trajectory | None = None,
      tag: str = "train",
      ignore_eos: bool = False,
      stop_strings: tuple[str, ...] = (),
      hold: str = "",
      keep_version: bool = True,
      server: str | None = None,
  ) -> RolloutResult:
    """Runs one request to completion (or abort), failing over on server failures.

    Multi-turn: ``stop_strings`` end a turn at a tool call; ``hold`` keeps the
    turn's version pinned on its server afterwards (``RolloutRequest.hold``);
    ``server`` sends the request to that server only (where the hold lives):
    if it is not up, or fails, :class:`VersionUnavailableError` is raised
    instead of failing over, since no other server holds the pinned version.
    ``keep_version=False``: the hold pins nothing (a per-turn version hop,
    ``RolloutRequest.keep_version``). The result names the server that
    generated it (``result.server``).
    """
    self._ensure_monitor()
    abort_gen = None if tag == EVAL_TAG else self._abort_gen
    extra = dict(stop_strings=tuple(stop_strings), hold=hold, keep_version=keep_version)
    resume = resume_parts(resume)  # the partial trajectory's completion, derived once
    if server is not None:
      return await self._run_on(server, prompt, prompt_tokens, member, max_new_tokens,
                                version=version, resume=resume, tag=tag, ignore_eos=ignore_eos,
                                abort_gen=abort_gen, **extra)
    attempts = 0
    failed_on: _ServerSlot | None = None
    retry_at = 0.0
    group = (tag, prompt.sample_id)  # the GRPO group: its members share one prompt
    while True:
      s = await self._acquire(abort_gen, failed_on, group)
      if s is None:
        return self._aborted(f"{tag}-{prompt.sample_id}-{member}-aborted", resume)
      if s is failed_on and self._loop.time() < retry_at:
        # The only admitted server is the one it just failed on: back off.
        await self._wait_change(retry_at - self._loop.time())
        continue
      rid = f"{tag}-{prompt.sample_id}-{member}-{next(self._ids)}"
      req = self._request(rid, prompt_tokens, max_new_tokens, version, resume, ignore_eos, **extra)
      self._affinity.started(group, s)
      try:
        return await self._attempt(s, req)
      except VersionUnavailableError:
        raise  # the caller pinned a version the server no longer holds: not a crash
      except RolloutError as e:
        attempts += 1
        self._suspect(s, e)
        if self._max_attempts and attempts >= self._max_attempts:
          log.error("request %s failed %d times; giving up: %s", rid, attempts, e)
          raise
        if self._on_reissue is not None:
          self._on_reissue(prompt.sample_id, member, str(e))
        log.warning("request %s failed on %s (%s); re-issuing", rid, s.client.name, e)
        failed_on, retry_at = s, self._loop.time() + self._retry_delay(attempts)
      finally:
        self._affinity.finished(group)

  async def _attempt(self, s: _ServerSlot, req: RolloutRequest) -> RolloutResult:
    """``req`` on ``s``, counted in flight (and reachable by ``abort_all``) while it runs;
    the result names the server (``RolloutResult.server``: hold affinity)."""
    s.in_flight += 1
    self._active[req.request_id] = s
    try:
      result = await self._guarded(s, s.client.generate(req))
      return dataclasses.replace(result, server=s.client.name)
    finally:
      s.in_flight -= 1
      self._active.pop(req.request_id, None)


  def _request(self, rid: str, prompt_tokens: np.ndarray, max_new_tokens: int,
               version: int | None, resume: ResumeParts | None, ignore_eos: bool,
               **extra: Any) -> RolloutRequest:
    return RolloutRequest(
        request_id=rid,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new_tokens,
        version=version,
        ignore_eos=ignore_eos,
        incarnation=self.incarnation or "",
        **(resume.request_fields() if resume is not None else {}),
        **extra,
    )

  async def _run_on(self, name: str, prompt: Prompt, prompt_tokens: np.ndarray, member: int,
                    max_new_tokens: int, *, version: int | None, resume: ResumeParts | None,
                    tag: str, ignore_eos: bool, abort_gen: int | None,
                    **extra: Any) -> RolloutResult:
    """One attempt on server ``name`` (hold affinity): no failover, see :meth:`run`."""
    s = next((x for x in self._servers if x.client.name == name), None)
    if s is None or not s.alive:
      raise VersionUnavailableError(
          f"rollout server {name}, which holds this trajectory's version, is"
          f" {'unknown' if s is None else s.state}")
    if abort_gen is not None and self._abort_gen != abort_gen:
      return self._aborted(f"{tag}-{prompt.sample_id}-{member}-aborted", resume)
    rid = f"{tag}-{prompt.sample_id}-{member}-{next(self._ids)}"
    req = self._request(rid, prompt_tokens, max_new_tokens, version, resume, ignore_eos, **extra)
    try:
      return await self._attempt(s, req)
    except VersionUnavailableError:
      raise
    except RolloutError as e:
      self._suspect(s, e)
      raise VersionUnavailableError(
          f"rollout server {name} failed while holding this trajectory's version: {e}",
          (rid,)) from e


  async def release_hold(self, name: str, hold: str) -> None:
    """Releases a multi-turn version hold on server ``name`` (best effort: a
    server that is gone took its holds with it, and holds also time out)."""
    s = next((x for x in self._servers if x.client.name == name), None)
    if s is None or s.state not in (UP, SUSPECT):
      return
    try:
      await self._guarded(s, s.client.abort([hold]))
    except Exception as e:  # pylint: disable=broad-exception-caught
      log.debug("releasing hold %s on %s failed: %s", hold, name, e)


def resume_parts(partial: Trajectory | None) -> ResumeParts | None:
  """What a request continuing ``partial`` carries (None: nothing generated yet)."""
  if partial is None or not partial.num_completion_tokens:
    return None
  return ResumeParts(np.asarray(partial.completion_tokens, np.int32),
                     np.asarray(partial.behaviour_logprobs, np.float32), tuple(partial.spans),
                     partial.routing)


def to_trajectory(
    prompt: Prompt,
    prompt_tokens: np.ndarray,
    member: int,
    result: RolloutResult,
    submit_time: float,
) -> Trajectory:
  """Builds the learner-facing record from a server result."""
  spans = list(result.spans)
  return Trajectory(
      sample_id=prompt.sample_id,
      member=member,
      prompt=prompt,
      prompt_tokens=np.asarray(prompt_tokens, np.int32),
      completion_tokens=np.asarray(result.completion_tokens, np.int32),
      behaviour_logprobs=np.asarray(result.logprobs, np.float32),
      spans=spans,
      finish_reason=result.finish_reason,
      start_version=min((sp.version for sp in spans), default=result.prefill_version),
      submit_time=submit_time,
      finish_time=time.time(),
      routing=result.routing,
  )
