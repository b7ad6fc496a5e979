"""gRPC server mode: one :class:`RolloutDriver` behind the ``jax_dora.Rollout`` service.

Why our own service rather than JetStream's ``server_lib``/``orchestrator``:

* JetStream's ``DecodeResponse`` carries token ids (and text) only: no per-token
  log-probs and no policy version. DORA's learner needs the behaviour log-prob
  of every token for its importance ratios, and the orchestrator needs the
  version that produced each token (``TokenSpan``) to enforce staleness bounds.
* JetStream's ``Driver`` holds one ``params`` per engine (``_prefill_params[i]``,
  ``_generate_params[i]``). DORA keeps several policy versions resident and
  pins each slot to the version that started it, which is the job of our
  ``RolloutDriver``/``VersionStore``; it also needs ``LoadVersion`` and
  ``Abort`` (with the partial trajectory returned for resumption), which the
  JetStream service has no RPC for.

We keep JetStream's server structure: a ``grpc.aio`` server in front of a
driver whose own thread runs the continuous-batching loop, with results
crossing from that thread to the event loop through per-request queues. The
engine itself is still a JetStream ``engine_api.Engine`` (``DoraEngine``).

Failure semantics: a client that cancels its ``Generate`` call (or whose
deadline expires, or whose connection drops) makes gRPC cancel the handler
task; the handler then calls ``driver.abort`` so the slot is freed instead of
decoding for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from jax_dora.rollout import api
from jax_dora.rollout import wire
from jax_dora.rollout import wire_delta

_log = logging.getLogger(__name__)

# Let clients keep the connection alive with pings (they detect a silently
# dead peer that way); without these the server would answer frequent pings
# with GOAWAY "too_many_pings".
SERVER_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


class Driver(Protocol):
  """What the server needs from ``jax_dora.rollout.driver.RolloutDriver``."""

  def load_version(self, version: int, incarnation: str | None = None,
                   source: Any = None) -> None: ...

  def submit(self, request: api.RolloutRequest, callback) -> None: ...

  def abort(self, request_ids: list[str]) -> None: ...

  def status(self) -> api.ServerStatus: ...


def _load_error_code(e: BaseException) -> grpc.StatusCode:
  """Maps a ``load_version`` failure onto a status the client can act on."""
  # Imported lazily: the snapshot store pulls in Orbax, which the wire/server
  # layer should not need just to be imported.
  from jax_dora.snapshots import SnapshotNotFoundError  # pylint: disable=g-import-not-at-top

  if isinstance(e, (SnapshotNotFoundError, api.VersionUnavailableError)):
    return grpc.StatusCode.NOT_FOUND
  if isinstance(e, (ValueError, TypeError)):
    return grpc.StatusCode.INVALID_ARGUMENT
  return grpc.StatusCode.INTERNAL


class RolloutServer:
  """Serves a driver on ``host:port`` (port 0 = pick a free one).

  ``start``/``stop``/``wait_for_termination`` are coroutines and must run on
  one event loop (the one ``grpc.aio`` binds to at ``start``).
  """

  def __init__(
      self,
      driver: Driver,
      port: int,
      host: str = "127.0.0.1",
      name: str = "rollout",
      transfer_host: str = "127.0.0.1",
  ):
    """``transfer_host``: where this server's JAX transfer server binds to pull offers
    (``snapshots.transport=transfer_server``; started on the first offer)."""
    self._driver = driver
    self._host = host
    self._transfer_host = transfer_host
    self._requested_port = int(port)
    self._port: int | None = None
    self._name = name
    self._server: grpc.aio.Server | None = None
    # Requests whose stream is still open here, so duplicate ids are refused
    # (the driver and the client both key on request_id). Only touched on
    # the event loop, so it needs no lock.
    self._active: set[str] = set()
    # Multi-turn bases of the requests that arrive as deltas (wire_delta.py); like
    # _active, only touched on the event loop.
    self._contexts = wire_delta.HeldContexts()
    # Reported by Health; a new value at the same address = a restart.
    self._instance = uuid.uuid4().hex

  @property
  def instance(self) -> str:
    return self._instance

  @property
  def port(self) -> int:
    if self._port is None:
      raise RuntimeError("RolloutServer.port is known only after start()")
    return self._port

  @property
  def address(self) -> str:
    return f"{self._host}:{self.port}"

  async def start(self) -> None:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((self._handler(),))
    target = f"{self._host}:{self._requested_port}"
    port = server.add_insecure_port(target)
    if port == 0:
      raise OSError(f"could not bind rollout server to {target}")
    self._port = port
    await server.start()
    self._server = server
    _log.info("rollout server %s listening on %s", self._name, self.address)

  async def stop(self, grace: float | None = 2.0) -> None:
    """Stops accepting calls; in-flight calls get ``grace`` seconds."""
    if self._server is not None:
      await self._server.stop(grace)

  async def wait_for_termination(self, timeout: float | None = None) -> bool:
    if self._server is None:
      raise RuntimeError("RolloutServer not started")
    return await self._server.wait_for_termination(timeout)

  def _handler(self) -> grpc.GenericRpcHandler:
    unary = lambda fn, req_type: grpc.unary_unary_rpc_method_handler(  # pylint: disable=g-long-lambda
        fn,
        request_deserializer=wire.loads_as(req_type),
        response_serializer=wire.dumps,
    )
    return grpc.method_handlers_generic_handler(
        wire.SERVICE,
        {
            wire.GENERATE: grpc.unary_stream_rpc_method_handler(
                self._generate,
                request_deserializer=wire.loads_as((api.RolloutRequest, wire.ResumeDelta)),
                response_serializer=wire.dumps,
            ),
            wire.LOAD_VERSION: unary(self._load_version, dict),
            wire.ABORT: unary(self._abort, dict),
            wire.STATUS: unary(self._status, dict),
            wire.HEALTH: unary(self._health, dict),
        },
    )

  async def _generate(
      self, message: api.RolloutRequest | wire.ResumeDelta, context: grpc.aio.ServicerContext
  ) -> AsyncIterator[Any]:
    """Streams the driver's chunks, then exactly one result or error frame.

    A :class:`wire.ResumeDelta` (a next turn without the context held here) is
    expanded first and its result goes back without that context
    (``wire_delta.py``); the driver only ever sees full requests.
    """
    del context
    delta = isinstance(message, wire.ResumeDelta)
    rid = message.request.request_id if delta else message.request_id
    try:
      request = wire_delta.expand_request(self._contexts, message)
    except (wire.ResumeBaseMissingError, ValueError) as e:
      yield wire.WireError.from_exception(e, rid)
      return
    if rid in self._active:
      yield wire.WireError(
          "RolloutError",
          f"request_id {rid!r} is already in flight on {self._name}",
          (rid,),
      )
      return
    self._active.add(rid)

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def callback(item: Any) -> None:
      # Runs on the driver thread. After the handler is gone (cancelled, or
      # the server is shutting down) the loop may be closed: drop the item,
      # nobody is listening any more.
      try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
      except RuntimeError:
        pass

    finished = False
    try:
      try:
        # submit/abort/status only touch the driver's queues under a short
        # lock, so they run inline: routing them through the default
        # executor (a handful of threads) would let a slow LoadVersion
        # starve every new stream.
        self._driver.submit(request, callback, stream=bool(request.stream))
      except Exception as e:  # pylint: disable=broad-except
        finished = True
        yield wire.WireError.from_exception(e, rid)
        return
      while True:
        item = await queue.get()
        if isinstance(item, BaseException):
          finished = True
          yield wire.WireError.from_exception(item, rid)
          return
        if isinstance(item, api.RolloutResult):
          finished = True
          self._contexts.after_result(request, item)
          yield wire_delta.strip_result(request, item) if delta else item
          return
        yield item
    finally:
      self._active.discard(rid)
      if not finished:
        # Cancelled by the client, its deadline, or a dropped connection:
        # free the slot. ``abort`` is thread-safe and cheap; its final
        # "aborted" result lands in a queue nobody reads, which is fine.
        _log.info("request %s cancelled by client; aborting", rid)
        try:
          self._driver.abort([rid])
        except Exception:  # pylint: disable=broad-except
          _log.exception("abort of cancelled request %s failed", rid)

  async def _load_version(
      self, request: dict, context: grpc.aio.ServicerContext
  ) -> dict:
    version = request.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
      await context.abort(
          grpc.StatusCode.INVALID_ARGUMENT,
          f"LoadVersion needs an int version, got {version!r}",
      )
    incarnation = request.get("incarnation")
    if incarnation is not None and not isinstance(incarnation, str):
      await context.abort(
          grpc.StatusCode.INVALID_ARGUMENT,
          f"LoadVersion incarnation must be a string, got {incarnation!r}",
      )
    transfer = request.get("transfer")
    source = None
    if transfer is not None:
      if not isinstance(transfer, dict) or not {"address", "uuid", "tensor_parallel"} <= set(
          transfer):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"LoadVersion transfer must be an offer dict, got {transfer!r}")
      from jax_dora.snapshots.transfer import TransferSource  # pylint: disable=g-import-not-at-top

      source = TransferSource(transfer, version, host=self._transfer_host)
    try:
      # Loading reads a snapshot from disk (or pulls an offer) and transfers it
      # to devices: keep the event loop (and every other stream) running meanwhile.
      await asyncio.to_thread(self._driver.load_version, version, incarnation, source)
    except Exception as e:  # pylint: disable=broad-except
      _log.warning("LoadVersion(%s) failed: %s", version, e)
      await context.abort(
          _load_error_code(e),
          f"{self._name}: cannot load version {version}: "
          f"{type(e).__name__}: {e}",
      )
    status = self._driver.status()
    _log.info(
        "loaded version %d; versions loaded %s",
        version,
        list(status.versions_loaded),
    )
    return {"versions_loaded": list(status.versions_loaded)}

  async def _abort(
      self, request: dict, context: grpc.aio.ServicerContext
  ) -> dict:
    ids = request.get("request_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
      await context.abort(
          grpc.StatusCode.INVALID_ARGUMENT,
          f"Abort needs a list of request ids, got {ids!r}",
      )
    self._driver.abort(list(ids))
    self._contexts.forget(ids)
    return {}

  async def _status(
      self, request: dict, context: grpc.aio.ServicerContext
  ) -> api.ServerStatus:
    del request, context
    return self._driver.status()

  async def _health(
      self, request: dict, context: grpc.aio.ServicerContext
  ) -> dict:
    """Liveness for the dispatcher's monitor (cheap: no device work).

    ``instance`` is this server object's id, fixed for its lifetime: a
    changed value at the same address means the process was restarted (the
    dispatcher counts restarts with it). ``generated_tokens`` lets it check
    that a server with requests in flight is making progress. A driver whose
    loop crashed or stopped answers ``UNAVAILABLE``: the process is up but
    cannot serve.
    """
    del request
    check_alive = getattr(self._driver, "check_alive", None)
    if check_alive is not None:
      try:
        check_alive()
      except api.RolloutError as e:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self._name}: {e}")
    return api.health_reply(self._name, self._instance, self._driver.status())
