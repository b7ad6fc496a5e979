"""In-process rollout servers: :class:`RolloutDriver` behind the asyncio client API.

Used when learner and rollout share one process (CPU, Colab, single host). The
driver runs its own thread; this adapter bridges its callbacks into asyncio
with ``loop.call_soon_threadsafe`` so the orchestrator sees exactly the same
:class:`~jax_dora.rollout.api.RolloutClient` as with a remote gRPC server.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Sequence

import jax

from jax_dora.config import RunConfig
from jax_dora.rollout import api
from jax_dora.rollout.driver import RolloutDriver
from jax_dora.rollout.engine import build_engine
from jax_dora.snapshots import SnapshotReader, as_reader

_log = logging.getLogger(__name__)


class SharedSnapshotLoader:
  """Reads each snapshot version once per process for all embedded servers.

  Every server needs the same params on its own devices. Restoring through
  Orbax costs far more than the bytes (metadata, tensorstore, threads), so the
  first server to ask restores the version and the others copy it onto their
  devices. Concurrent requests for one version wait for that single read; a
  failed read is not cached (the next caller retries and sees the error). Only
  the newest ``keep`` versions stay cached.
  """

  def __init__(self, reader: SnapshotReader, keep: int = 2):
    self._reader = reader
    self._keep = max(1, int(keep))
    self._lock = threading.Lock()
    self._cache: collections.OrderedDict[tuple[int, str | None], concurrent.futures.Future] = collections.OrderedDict()
    self.reads = 0  # Orbax restores done (tests, metrics)

  def load(self, engine, version: int, incarnation: str | None = None):
    key = (int(version), incarnation)  # numbers of different incarnations differ
    with self._lock:
      fut = self._cache.get(key)
      owner = fut is None
      if owner:
        fut = self._cache[key] = concurrent.futures.Future()
        while len(self._cache) > self._keep:
          self._cache.popitem(last=False)
    if owner:
      try:
        params = engine.load_params(self._reader, key[0], incarnation)
        self.reads += 1
      except BaseException as e:
        with self._lock:
          if self._cache.get(key) is fut:
            del self._cache[key]
        fut.set_exception(e)
        raise
      fut.set_result(params)
      return params
    return engine.place_params(fut.result())


class EmbeddedRolloutClient:
  """:class:`api.RolloutClient` over a local :class:`RolloutDriver`."""

  # A stopped in-process driver never comes back: the dispatcher retires it
  # on its first failed health check instead of waiting for a restart.
  restartable = False

  def __init__(self, driver: RolloutDriver):
    self.driver = driver
    self.name = driver.name
    self._closed = False
    self._instance = uuid.uuid4().hex  # Health's process id (never changes here)

  async def load_version(self, version: int, incarnation: str | None = None) -> None:
    # Loading reads files and copies to device: keep it off the event loop.
    await asyncio.to_thread(self.driver.load_version, version, incarnation)

  async def stream(self, request: api.RolloutRequest) -> AsyncIterator[api.RolloutChunk]:
    """Yields chunks, then the final :class:`RolloutResult`; raises RolloutError.

    If the consumer stops iterating early (cancelled, ``aclose``), the request
    is aborted so its slot is freed rather than decoding for nobody.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def callback(item) -> None:  # Runs on the driver thread.
      try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
      except RuntimeError:  # Event loop already closed: nobody is listening.
        pass

    self.driver.submit(request, callback)
    done = False
    try:
      while True:
        item = await queue.get()
        if isinstance(item, api.RolloutError):
          done = True
          raise item
        if isinstance(item, api.RolloutResult):
          done = True
          yield item
          return
        yield item
    finally:
      if not done:
        self.driver.abort([request.request_id])

  async def generate(self, request: api.RolloutRequest) -> api.RolloutResult:
    """The final result only: no per-token chunks cross the thread boundary.

    Cancelling the caller aborts the request (its slot is freed).
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(item) -> None:  # Event loop thread.
      if fut.done():
        return
      if isinstance(item, api.RolloutError):
        fut.set_exception(item)
      else:
        fut.set_result(item)

    def callback(item) -> None:  # Driver thread; only the terminal item arrives.
      try:
        loop.call_soon_threadsafe(settle, item)
      except RuntimeError:  # Event loop already closed: nobody is listening.
        pass

    self.driver.submit(request, callback, stream=False)
    try:
      return await asyncio.shield(fut)
    except asyncio.CancelledError:
      if not fut.done():
        self.driver.abort([request.request_id])
      raise

  async def abort(self, request_ids: list[str]) -> None:
    self.driver.abort(list(request_ids))

  async def status(self) -> api.ServerStatus:
    return self.driver.status()

  async def health(self, timeout_s: float = 5.0) -> dict:
    """As ``GrpcRolloutClient.health``; raises RolloutError once the driver
    is stopped or its loop crashed (``status`` would still answer)."""
    del timeout_s  # in-process: nothing to wait for
    self.driver.check_alive()
    return api.health_reply(self.name, self._instance, self.driver.status())

  async def close(self) -> None:
    if not self._closed:
      self._closed = True
      await asyncio.to_thread(self.driver.stop)


def build_embedded_servers(
    config, snapshot_dir, devices: Sequence[jax.Device], policy=None
) -> list[EmbeddedRolloutClient]:
  """``config.rollout.num_servers`` drivers on disjoint slices of ``devices``.

  Each server gets ``devices_per_server`` consecutive devices. With a single
  device (plain CPU) all servers share it, which is the only overlap allowed.
  ``policy``: the run's resolved ``jax_dora.policy.PolicySpec`` (resolved
  from ``config`` when not given). ``snapshot_dir``: the snapshot directory, or a reader over
  it (the in-memory transport's ``TieredReader``).
  """
  if policy is None:
    from jax_dora.policy import resolve_policy  # pylint: disable=g-import-not-at-top

    policy = resolve_policy(config)
  config = RunConfig.of(config)
  r = config.rollout
  n, per = r.num_servers, max(1, r.devices_per_server)
  devices = list(devices)
  if len(devices) >= n * per:
    slices = [devices[i * per:(i + 1) * per] for i in range(n)]
  elif len(devices) == 1:
    _log.warning("one device for %d rollout server(s): they share it", n)
    slices = [devices] * n
  else:
    raise ValueError(
        f"{n} rollout servers x {per} devices need {n * per} devices, got {len(devices)}"
    )
  seeds = itertools.count(config.seed * 1000 + 17)
  reader = as_reader(snapshot_dir)
  loader = SharedSnapshotLoader(reader)
  clients = []
  for i, devs in enumerate(slices):
    engine = build_engine(config, devs, seed=next(seeds), policy=policy)
    driver = RolloutDriver(
        engine, reader, max_versions=r.max_versions, name=f"server{i}",
        load_fn=functools.partial(loader.load, engine),
        precompile=config.precompile, hold_timeout_s=r.hold_timeout_s,
        held_kv_slots=config.held_kv_rows,
    )
    clients.append(EmbeddedRolloutClient(driver))
  return clients
