"""In-process rollout servers: :class:`RolloutDriver` behind the asyncio client API.

Used when learner and rollout share one process (CPU, Colab, single host). The
driver runs its own thread; this adapter bridges its callbacks into asyncio
with ``loop.call_soon_threadsafe`` so the orchestrator sees exactly the same
:class:`~jax_dora.rollout.api.RolloutClient` as with a remote gRPC server.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Sequence

import jax

from jax_dora.rollout import api
from jax_dora.rollout.driver import RolloutDriver
from jax_dora.rollout.engine import build_engine

_log = logging.getLogger(__name__)


class EmbeddedRolloutClient:
  """:class:`api.RolloutClient` over a local :class:`RolloutDriver`."""

  def __init__(self, driver: RolloutDriver):
    self.driver = driver
    self.name = driver.name
    self._closed = False

  async def load_version(self, version: int) -> None:
    # Loading reads files and copies to device: keep it off the event loop.
    await asyncio.to_thread(self.driver.load_version, version)

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
    result = None
    async for item in self.stream(request):
      if isinstance(item, api.RolloutResult):
        result = item
    if result is None:  # The stream contract guarantees a result; be explicit.
      raise api.RolloutError(f"{self.name}: stream ended without a result", (request.request_id,))
    return result

  async def abort(self, request_ids: list[str]) -> None:
    self.driver.abort(list(request_ids))

  async def status(self) -> api.ServerStatus:
    return self.driver.status()

  async def close(self) -> None:
    if not self._closed:
      self._closed = True
      await asyncio.to_thread(self.driver.stop)


def build_embedded_servers(
    config, snapshot_dir: str, devices: Sequence[jax.Device]
) -> list[EmbeddedRolloutClient]:
  """``config.rollout.num_servers`` drivers on disjoint slices of ``devices``.

  Each server gets ``devices_per_server`` consecutive devices. With a single
  device (plain CPU) all servers share it, which is the only overlap allowed.
  """
  r = config.rollout
  n, per = int(r.num_servers), max(1, int(r.devices_per_server))
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
  seeds = itertools.count(int(config.seed) * 1000 + 17)
  clients = []
  for i, devs in enumerate(slices):
    engine = build_engine(config, devs, seed=next(seeds))
    driver = RolloutDriver(engine, snapshot_dir, max_versions=r.max_versions, name=f"server{i}")
    clients.append(EmbeddedRolloutClient(driver))
  return clients
