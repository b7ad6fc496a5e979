"""Background publishing: the Orbax write of a new version off the learner's path.

In the asynchronous modes the learner only copies its params after a step
and goes on training; this pipeline writes the copy and makes the servers
load it. One write is in flight at a time, and versions produced while one is
being written are coalesced: only the newest is published next (servers only
ever start new requests on the newest version, so an intermediate snapshot
nobody would load is skipped). Staleness is still counted in learner
versions, so a skipped publish can only make data staler, never hide it from
the bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


class BackgroundPublisher:
  """Publishes versions newest-first, one at a time, then calls ``on_published``."""

  def __init__(
      self,
      publisher: Any,
      initial_version: int,
      on_published: Callable[[int], Awaitable[None]],
      spawn: Callable[[Awaitable[None]], asyncio.Task],
      on_error: Callable[[BaseException], None],
  ):
    self._publisher = publisher
    self._on_published = on_published
    self._spawn = spawn
    self._on_error = on_error
    self._next: tuple[int, Any, bool] | None = None
    self._task: asyncio.Task | None = None
    self.published_version = int(initial_version)
    self.skipped = 0  # versions coalesced away
    self.last_write_s = 0.0

  def submit(self, version: int, params: Any, owned: bool = False) -> None:
    """Queues ``version`` (a detached params copy); supersedes a queued one.

    ``owned``: ``params`` is a copy nobody else holds, already in the publisher's write
    dtype (``learner.detached_params``): the in-memory transport serves it as it is."""
    if self._next is not None:
      self.skipped += 1
    self._next = (version, params, owned)
    if self._task is None or self._task.done():
      self._task = self._spawn(self._loop())

  async def _loop(self) -> None:
    try:
      while self._next is not None:
        version, params, owned = self._next
        self._next = None
        t0 = time.time()
        await asyncio.to_thread(self._publisher.publish, version, params, {"step": version},
                                owned=owned)
        self.published_version = version
        self.last_write_s = time.time() - t0
        await self._on_published(version)
    except Exception as e:  # pylint: disable=broad-exception-caught
      self._on_error(e)

  async def flush(self) -> None:
    """Waits until every queued version is published and loaded."""
    while self._task is not None and not self._task.done():
      await asyncio.shield(self._task)
