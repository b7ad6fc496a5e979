"""In-memory versions: the learner's parameters handed to embedded servers without files.

Why: DORA publishes a version every learner step and every server loads each
one, so the seconds from "the learner has version v" to "a server can decode
with v" bound the whole system. Through Orbax that is a device -> host copy,
serialisation, a write, a read, deserialisation and a host -> device copy
(7.4 s to publish a 0.5B float32 tree on the 2-core CI machine). When the
servers live in the learner's process (the main job, Colab, one host) none of
that is needed: :class:`MemorySnapshots` keeps a copy of each version on the
learner's devices, already cast to the servers' dtype, and a server's load is
one ``jax.device_put`` onto its own mesh (a device-to-device copy / reshard),
then the same checksum verification a file restore gets.

:class:`TieredReader` is what servers and the audits read through: the memory
tier first, the Orbax directory second (durable versions: recovery, the
offline audit, a version evicted from memory). :class:`TransportPublisher` is
what the learner publishes through: every version into memory (servable at
once), every ``durable_every``-th version also to Orbax, written in order by a
background thread. Every due version is written (``time_to_reward`` and the
audits read them); the learner waits only when ``max_pending`` writes are
already queued (each queued version holds a parameter copy), and that wait is
counted. Integrity is the file path's: one checksum record per version,
computed from the tree handed over, verified by every load.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from jax_dora.model.param_copy import cast_copy
from jax_dora.snapshots import checksum
from jax_dora.snapshots.store import (
    SnapshotError,
    SnapshotIntegrityError,
    SnapshotNotFoundError,
    SnapshotPublisher,
    SnapshotReader,
)

_log = logging.getLogger(__name__)

PyTree = Any


def place_verified(tree: PyTree, target: PyTree, metadata: dict[str, Any], what: str) -> PyTree:
  """``tree`` cast and copied onto ``target``'s dtypes and shardings, then checked against
  the checksum record in ``metadata`` (``SnapshotIntegrityError`` naming ``what``): the one
  placement both in-memory paths (a held copy, a pulled offer) use."""
  placed = jax.device_put(
      jax.tree.map(lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype), tree, target),
      jax.tree.map(lambda t: t.sharding, target))
  tables = metadata.get("checksums")
  if tables:
    problem, _ = checksum.first_mismatch(checksum.checksums(placed), tables)
    if problem is not None:
      raise SnapshotIntegrityError(f"{what} does not hold the parameters its publisher recorded:"
                                   f" {problem}. Refusing to load it.")
  return placed


class MemorySnapshots:
  """The newest ``keep`` versions, each a params tree on the learner's devices plus its metadata.

  ``load`` places a version onto the caller's shardings and verifies it against
  the checksums recorded when it was put, exactly as ``SnapshotReader.load``
  does for a file, so a server cannot tell the tiers apart except by speed.
  """

  def __init__(self, keep: int):
    self.keep = max(1, int(keep))
    self._lock = threading.Lock()
    self._versions: collections.OrderedDict[int, tuple[PyTree, dict[str, Any]]] = (
        collections.OrderedDict())
    self.integrity_failures = 0
    self.loads = 0

  def put(self, version: int, params: PyTree, metadata: dict[str, Any]) -> None:
    """Makes ``version`` servable; ``params`` must be a tree nobody will donate or mutate."""
    with self._lock:
      self._versions[int(version)] = (params, dict(metadata))
      self._versions.move_to_end(int(version))
      while len(self._versions) > self.keep:
        self._versions.popitem(last=False)

  def discard_after(self, version: int) -> None:
    with self._lock:
      for v in [v for v in self._versions if v > version]:
        del self._versions[v]

  def versions(self) -> list[int]:
    with self._lock:
      return sorted(self._versions)

  def has_version(self, version: int) -> bool:
    with self._lock:
      return int(version) in self._versions

  def read_metadata(self, version: int) -> dict[str, Any]:
    return dict(self.get(version)[1])

  def get(self, version: int) -> tuple[PyTree, dict[str, Any]]:
    """``(the held tree, its metadata)``; ``SnapshotNotFoundError`` if not held."""
    with self._lock:
      found = self._versions.get(int(version))
      held = sorted(self._versions)
    if found is None:
      raise SnapshotNotFoundError(f"version {version} is not in memory (held: {held})")
    return found

  def load(self, version: int, target: PyTree | None = None,
           incarnation: str | None = None) -> tuple[PyTree, dict[str, Any]]:
    """``(params on target's shardings and dtypes, metadata)``, verified by checksum.

    Raises:
      SnapshotNotFoundError: not held (never put, evicted) or of another incarnation.
      SnapshotIntegrityError: the placed tree is not the one recorded.
    """
    params, metadata = self.get(version)
    found = metadata.get("incarnation")
    if incarnation is not None and found != incarnation:
      raise SnapshotNotFoundError(
          f"in-memory version {version} belongs to run incarnation {found!r}, not {incarnation!r}")
    try:
      placed = place_verified(params, params if target is None else target, metadata,
                              f"in-memory version {version}")
    except SnapshotIntegrityError:
      self.integrity_failures += 1
      raise
    self.loads += 1
    return placed, dict(metadata)


class TieredReader:
  """A ``SnapshotReader`` look-alike: memory first, then the Orbax directory."""

  def __init__(self, memory: MemorySnapshots, disk: SnapshotReader):
    self.memory = memory
    self.disk = disk

  @property
  def directory(self):
    return self.disk.directory

  @property
  def verify_checksums(self) -> bool:
    return self.disk.verify_checksums

  @property
  def integrity_failures(self) -> int:
    return self.memory.integrity_failures + self.disk.integrity_failures

  def versions(self) -> list[int]:
    return sorted(set(self.memory.versions()) | set(self.disk.versions()))

  def latest_version(self) -> int | None:
    versions = self.versions()
    return versions[-1] if versions else None

  def has_version(self, version: int) -> bool:
    return self.memory.has_version(version) or self.disk.has_version(version)

  def read_metadata(self, version: int) -> dict[str, Any]:
    if self.memory.has_version(version):
      try:
        return self.memory.read_metadata(version)
      except SnapshotNotFoundError:
        pass  # evicted since: the durable copy, if any
    return self.disk.read_metadata(version)

  def wait_for_version(self, min_version: int, timeout_s: float, poll_s: float = 0.05) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
      latest = self.latest_version()
      if latest is not None and latest >= min_version:
        return latest
      if time.monotonic() >= deadline:
        raise TimeoutError(f"no snapshot version >= {min_version} after {timeout_s:.3f}s"
                           f" (latest: {latest})")
      time.sleep(poll_s)

  def load(self, version: int | None = None, target: PyTree | None = None,
           incarnation: str | None = None) -> tuple[PyTree, dict[str, Any]]:
    if version is None:
      version = self.latest_version()
      if version is None:
        raise SnapshotNotFoundError(f"no snapshots in memory or in {self.directory}")
    if self.memory.has_version(version):
      try:
        return self.memory.load(version, target, incarnation)
      except SnapshotNotFoundError:
        if not self.disk.has_version(version):
          raise
    return self.disk.load(version, target, incarnation)


class TransportPublisher:
  """Publishes every version into memory and every ``durable_every``-th one to Orbax.

  Same interface as :class:`SnapshotPublisher` (``publish``, ``discard_after``,
  ``wait_until_finished``, ``close``, ``last_version``, ``directory``), so the
  orchestrator does not know which transport runs. ``durable_every=0`` writes
  only the first version (and any version the caller forces with
  ``durable=True``: a checkpoint, the end of the run).
  """

  def __init__(self, disk: SnapshotPublisher, memory: MemorySnapshots, durable_every: int,
               max_pending: int = 2,
               serve_layout: Callable[[PyTree], PyTree] | None = None):
    """``serve_layout(tree)``: the served copy re-laid out for the servers before it is kept
    (``TransferOffers.stage``: remote servers pull it as it is). None: the learner's layout
    (embedded servers read it in place)."""
    self.disk = disk
    self.serve_layout = serve_layout
    self.memory = memory
    self.durable_every = max(0, int(durable_every))
    self.max_pending = max(1, int(max_pending))
    self.incarnation = disk.incarnation
    self.checksum_casts = disk.checksum_casts
    self._last_version = disk.last_version
    self._cv = threading.Condition()
    self._pending: collections.deque[tuple[int, PyTree, dict[str, Any], dict[str, Any]]] = (
        collections.deque())
    self._writing = False
    self._error: BaseException | None = None
    self._closed = False
    self.durable_written = 0
    self.durable_wait_s = 0.0  # the learner waiting for a free place in the write queue
    self.last_durable_s = 0.0
    self._thread = threading.Thread(target=self._writer, name="durable-snapshots", daemon=True)
    self._thread.start()

  @property
  def directory(self):
    return self.disk.directory

  @property
  def last_version(self) -> int | None:
    return self._last_version

  @property
  def write_dtype(self) -> str | None:
    """The dtype versions are served and written in (the learner detaches straight into it)."""
    return self.disk.write_dtype

  def publish(self, version: int, params: PyTree, metadata: dict[str, Any] | None = None,
              durable: bool | None = None, owned: bool = False) -> None:
    """Makes ``version`` servable from memory now; queues its durable write if due.

    The served copy is cast to the write dtype on the learner's devices (what
    servers hold) and is also what the durable write saves, so a version costs
    one copy of the parameters, not two. ``owned``: ``params`` is already that
    copy (``learner.detached_params(version, dtype=write_dtype)``), held by nobody
    else; it is served as it is.
    """
    self._raise_writer_error()
    version = int(version)
    if self._last_version is not None and version <= self._last_version:
      raise ValueError(f"snapshot versions must strictly increase: got {version} after"
                       f" {self._last_version}")
    metadata = dict(metadata or {})
    served = params if owned else cast_copy(params, self.disk.write_dtype)
    if self.serve_layout is not None:
      served = self.serve_layout(served)
    tables = self.disk.checksum_record(served)
    full = dict(metadata, checksums=tables)
    if self.incarnation is not None:
      full["incarnation"] = self.incarnation
    self.memory.put(version, served, full)
    with self._cv:
      first = self.disk.last_version is None and not self.durable_written and not self._pending
      if durable is None:
        durable = first or (self.durable_every > 0 and version % self.durable_every == 0)
      if durable:
        t0 = time.time()
        while len(self._pending) >= self.max_pending and self._error is None:
          self._cv.wait()
        self.durable_wait_s += time.time() - t0
        self._pending.append((version, served, metadata, tables))
        self._cv.notify_all()
    self._last_version = version

  def _writer(self) -> None:
    while True:
      with self._cv:
        while not self._pending and not self._closed:
          self._cv.wait()
        if not self._pending and self._closed:
          return
        version, params, metadata, tables = self._pending.popleft()
        self._writing = True
      try:
        t0 = time.time()
        self.disk.publish(version, params, metadata, checksums=tables)
        self.last_durable_s = time.time() - t0
        self.durable_written += 1
      except BaseException as e:  # pylint: disable=broad-exception-caught
        _log.error("durable snapshot of version %d failed: %s", version, e)
        self._error = e
      finally:
        # Drop this thread's reference now: held until the next write, the version's
        # copy (a full parameter tree in accelerator memory) would outlive its eviction.
        del params, metadata, tables
        with self._cv:
          self._writing = False
          self._cv.notify_all()

  def _raise_writer_error(self) -> None:
    if self._error is not None:
      e, self._error = self._error, None
      raise SnapshotError(f"a durable snapshot write failed: {e}") from e

  def wait_until_finished(self) -> None:
    with self._cv:
      while self._pending or self._writing:
        self._cv.wait()
    self.disk.wait_until_finished()
    self._raise_writer_error()

  def discard_after(self, version: int) -> list[int]:
    self.wait_until_finished()
    self.memory.discard_after(version)
    removed = self.disk.discard_after(version)
    self._last_version = self.disk.last_version
    return removed

  def close(self) -> None:
    if self._closed:
      return
    self.wait_until_finished()
    with self._cv:
      self._closed = True
      self._cv.notify_all()
    self._thread.join(timeout=60)
    self.disk.close()

  def __enter__(self) -> "TransportPublisher":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
