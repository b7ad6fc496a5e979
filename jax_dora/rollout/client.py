"""gRPC implementation of :class:`jax_dora.rollout.api.RolloutClient`.

The orchestrator treats a remote server exactly like an embedded one, so the
one thing this client must add is *failure accounting*: when the server dies
(process killed, host preempted, network cut) every request that was in
flight on this client is reported in a :class:`RolloutError`, naming the
address, so the orchestrator can re-issue them instead of losing samples.

How a dead server is detected:

* A killed process on a reachable host: the kernel resets the TCP
  connection and every open stream fails at once with ``UNAVAILABLE``
  (loopback: milliseconds).
* A host that vanishes without a reset: HTTP/2 keepalive pings every
  ``_KEEPALIVE_MS`` and the channel declares the connection dead after
  ``_KEEPALIVE_TIMEOUT_MS`` without an ack, which again fails the streams.
* A stream that ends cleanly but without a final :class:`RolloutResult`
  (a server bug or a proxy cutting it) is treated the same way.
* A process that is alive but stopped answering (SIGSTOP, a wedged host)
  keeps its TCP connection and may even ack pings at the kernel level; that
  is caught one level up, by the dispatcher's health/progress monitor
  (:meth:`GrpcRolloutClient.health` with a short deadline), which cancels
  the streams of a server it declares down.

There is deliberately *no* deadline on ``Generate``: a long generation (or a
long wait in the server's queue) is not a failure, and a fixed deadline
counted from submission would fail long rollouts routinely. Liveness is the
dispatcher's job (health probes + token progress). Control RPCs keep
deadlines: ``timeout_s`` for ``Status``/``Abort``/``Health`` and the more
generous ``load_timeout_s`` for ``LoadVersion`` (a big model's snapshot takes
a while to restore).

Driver-side failures of a single request (e.g. its pinned version is not
loaded) arrive in-band as a :class:`wire.WireError` and are re-raised with the
same exception type and only that request's id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from jax_dora.rollout import api
from jax_dora.rollout import wire
from jax_dora.rollout import wire_delta

_log = logging.getLogger(__name__)

_KEEPALIVE_MS = 10_000
_KEEPALIVE_TIMEOUT_MS = 5_000
_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", _KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # Fail fast rather than queueing calls while the server is down: the
    # orchestrator, not the channel, decides whether and where to retry.
    ("grpc.enable_retries", 0),
    # Reconnect soon after a server comes back at the same address (the
    # defaults back off up to 120 s, which would delay its re-admission).
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)


class GrpcRolloutClient:
  """A :class:`api.RolloutClient` talking to one ``RolloutServer``.

  The channel is created lazily on first use because ``grpc.aio`` objects
  bind to the event loop they are created in, and clients are typically
  constructed (e.g. by :func:`connect_all`) before the orchestrator's loop
  runs.
  """

  # A process restarted at the same address serves again: the dispatcher may
  # re-admit it (an embedded driver, once stopped, cannot come back).
  restartable = True

  def __init__(
      self,
      address: str,
      timeout_s: float = 30.0,
      name: str | None = None,
      load_timeout_s: float = 600.0,
      offers: Any = None,
      tensor_parallel: int = 1,
      resume_deltas: bool = True,
  ):
    """``timeout_s``: deadline of Status/Abort/Health calls;
    ``load_timeout_s``: deadline of LoadVersion. Generate has none.
    ``offers``: the learner's ``TransferOffers`` (``snapshots.transport=transfer_server``):
    each LoadVersion then carries a fresh offer of the version for the server to pull,
    staged for its ``tensor_parallel``. ``resume_deltas``: a multi-turn next turn goes
    without the context the server holds, and comes back without it (``wire_delta.py``;
    ``rollout.resume_deltas``)."""
    self.offers = offers
    self._contexts = wire_delta.HeldContexts(
        wire_delta.DEFAULT_CAPACITY if resume_deltas else 0)
    # Since this client was made: Generate requests by how they went out
    # (wire_delta.SENT_AS) and the bytes of Generate frames each way.
    self._wire = dict.fromkeys(("request_bytes", "result_bytes")
                               + tuple(f"sent_{k}" for k in wire_delta.SENT_AS), 0)
    self.tensor_parallel = int(tensor_parallel)
    self.address = address
    self.name = name or f"grpc:{address}"
    self.timeout_s = float(timeout_s)
    self.load_timeout_s = float(load_timeout_s)
    self._channel: grpc.aio.Channel | None = None
    self._methods: dict[str, Any] = {}
    # Requests whose stream is open on this client, in submission order (a
    # dict as an ordered set): reported wholesale when the server dies.
    self._in_flight: dict[str, None] = {}

  @property
  def in_flight(self) -> tuple[str, ...]:
    return tuple(self._in_flight)

  def _method(self, method: str):
    if self._channel is None:
      self._channel = grpc.aio.insecure_channel(
          self.address, options=_CHANNEL_OPTIONS
      )
      for m in (wire.LOAD_VERSION, wire.ABORT, wire.STATUS, wire.HEALTH):
        self._methods[m] = self._channel.unary_unary(
            wire.method_path(m),
            request_serializer=wire.dumps,
            response_deserializer=wire.loads,
        )
      self._methods[wire.GENERATE] = self._channel.unary_stream(
          wire.method_path(wire.GENERATE),
          request_serializer=self._counted(wire.dumps, "request_bytes", out=True),
          response_deserializer=self._counted(wire.loads, "result_bytes", out=False),
      )
    return self._methods[method]

  def _counted(self, codec, key: str, out: bool):
    """``codec`` (wire.dumps or wire.loads) that adds the frame's bytes to ``key``."""
    def run(x):
      y = codec(x)
      self._wire[key] += len(y if out else x)
      return y
    return run

  def wire_counters(self) -> dict[str, int]:
    """Generate traffic since this client was made (``RolloutTelemetry`` takes deltas):
    bytes each way, and requests sent in full, as deltas, and again in full after the
    server lacked a delta's base."""
    return dict(self._wire)

  def _lost(self, own_id: str, why: str) -> api.RolloutError:
    """The error for a stream lost to a transport failure.

    Lists every request in flight on this client (own id first): when the
    connection fails they are all lost, and the first stream to notice
    reports them all so that none is silently dropped even if the caller only
    inspects one error.
    """
    ids = [own_id] + [i for i in self._in_flight if i != own_id]
    return api.RolloutError(
        f"rollout server {self.address} failed while {len(ids)} request(s)"
        f" were in flight ({why}); in flight: {', '.join(ids)}",
        tuple(ids),
    )

  async def _unary(self, method: str, request: Any, timeout: float | None = None):
    try:
      return await self._method(method)(
          request, timeout=self.timeout_s if timeout is None else timeout
      )
    except grpc.aio.AioRpcError as e:
      code = e.code()
      msg = f"{method} on {self.address}: {code.name}: {e.details()}"
      if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
        raise api.VersionUnavailableError(msg) from e
      if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise ValueError(msg) from e
      raise api.RolloutError(msg, self.in_flight) from e

  async def stream(
      self, request: api.RolloutRequest
  ) -> AsyncIterator[api.RolloutChunk | api.RolloutResult]:
    """Yields chunks, then the final result (see :class:`api.RolloutClient`)."""
    rid = request.request_id
    if rid in self._in_flight:
      raise ValueError(f"request_id {rid!r} is already in flight on {self.name}")
    message = wire_delta.encode_request(self._contexts, request)
    self._in_flight[rid] = None
    try:
      while True:
        try:
          async for item in self._generate_call(rid, request, message):
            yield item
          return
        except wire.ResumeBaseMissingError:
          # Raised before any chunk: the server kept no identical base. Once more, in full.
          if message is request:
            raise
          self._wire["sent_base_missing"] += 1
          message = request
    finally:
      self._in_flight.pop(rid, None)

  async def _generate_call(self, rid: str, request: api.RolloutRequest,
                           message: api.RolloutRequest | wire.ResumeDelta
                           ) -> AsyncIterator[api.RolloutChunk | api.RolloutResult]:
    """One Generate call of ``request`` sent as ``message``: its chunks, then its result."""
    self._wire["sent_delta" if message is not request else "sent_full"] += 1
    # No deadline: see the module docstring (liveness is probed, not timed).
    call = self._method(wire.GENERATE)(message, timeout=None)
    got_result = False
    try:
      while True:
        try:
          item = await call.read()
        except grpc.aio.AioRpcError as e:
          raise self._lost(
              rid, f"{e.code().name}: {e.details()}"
          ) from e
        if item is grpc.aio.EOF:
          break
        if isinstance(item, wire.WireError):
          raise item.to_exception(f"{self.address}: ")
        if isinstance(item, (api.RolloutResult, wire.ResultDelta)):
          item = wire_delta.restore_result(request, item)
          self._contexts.after_result(request, item)
          got_result = True
          yield item
          break
        yield item
      if not got_result:
        raise self._lost(rid, "stream ended without a final result")
    finally:
      # Cancelling tells the server (via gRPC) to abort the request; a no-op
      # once the call has finished.
      call.cancel()

  async def generate(self, request: api.RolloutRequest) -> api.RolloutResult:
    """The final result only: the server sends no per-token chunks."""
    result = None
    async for item in self.stream(dataclasses.replace(request, stream=False)):
      result = item
    assert isinstance(result, api.RolloutResult)
    return result

  async def load_version(self, version: int, incarnation: str | None = None) -> None:
    request: dict[str, Any] = {"version": int(version), "incarnation": incarnation}
    if self.offers is not None:
      request["transfer"] = await asyncio.to_thread(self.offers.offer, version,
                                                    self.tensor_parallel)
    await self._unary(wire.LOAD_VERSION, request, timeout=self.load_timeout_s)

  async def abort(self, request_ids: list[str]) -> None:
    self._contexts.forget(request_ids)  # a released hold's base goes with it
    await self._unary(wire.ABORT, {"request_ids": [str(i) for i in request_ids]})

  async def status(self) -> api.ServerStatus:
    return await self._unary(wire.STATUS, {})

  async def health(self, timeout_s: float = 5.0) -> dict:
    """``{"live": True, "name", "instance", "versions_loaded", ...}`` or raises.

    ``instance`` identifies the server process (it changes on a restart);
    ``generated_tokens`` lets the caller check progress (see
    ``RolloutServer._health``).
    """
    return await self._unary(wire.HEALTH, {}, timeout=timeout_s)

  async def wait_ready(
      self, timeout_s: float = 60.0, min_versions: int = 0
  ) -> dict:
    """Polls Health until the server answers (with ``min_versions`` loaded).

    Used after launching a server process: binding the port, compiling and
    loading the first snapshot take a while and the orchestrator should not
    mistake that for a failure.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Exception | None = None
    while loop.time() < deadline:
      try:
        h = await self.health(timeout_s=min(5.0, timeout_s))
        if len(h.get("versions_loaded", ())) >= min_versions:
          return h
      except api.RolloutError as e:
        last = e
      await asyncio.sleep(0.2)
    raise api.RolloutError(
        f"rollout server {self.address} not ready after {timeout_s:.0f}s"
        f" (last error: {last})"
    )

  async def close(self) -> None:
    if self._channel is not None:
      await self._channel.close()
      self._channel = None
      self._methods.clear()


def connect_all(
    addresses: str, timeout_s: float = 30.0, load_timeout_s: float = 600.0,
    offers: Any = None, tensor_parallel: int = 1, resume_deltas: bool = True,
) -> list[GrpcRolloutClient]:
  """Clients for ``"host:port,host:port"`` (config.rollout.server_addresses).

  ``timeout_s`` / ``load_timeout_s``: control-RPC deadlines (see
  :class:`GrpcRolloutClient`); generation itself has no deadline.
  """
  out = []
  for a in addresses.split(","):
    a = a.strip()
    if not a:
      continue
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit():
      raise ValueError(f"bad rollout server address {a!r} in {addresses!r}; want host:port")
    out.append(
        GrpcRolloutClient(a, timeout_s=timeout_s, load_timeout_s=load_timeout_s,
                          offers=offers, tensor_parallel=tensor_parallel,
                          resume_deltas=resume_deltas)
    )
  if not out:
    raise ValueError(f"no rollout server addresses in {addresses!r}")
  return out
