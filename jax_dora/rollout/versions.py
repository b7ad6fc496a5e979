"""The policy versions one rollout server holds: loading, pending loads, run incarnations, holds.

* **Loading** runs in the caller of :meth:`ServerVersions.load_version` (file
  I/O never stalls decoding), except a *pending* version (no room among
  ``max_versions`` while older ones are still pinned), which the driver loop
  loads itself once room frees (:meth:`ServerVersions.load_pending`).
  A snapshot whose checksums fail is refused and counted; the server stays on
  the versions it has.
* **Incarnations**: version numbers of different run incarnations name
  different parameters. A load for another incarnation has the driver loop
  drop every held version and fail the requests still running on them
  (:meth:`ServerVersions.reset`), so an old "newer" version never shadows the
  new run's.
* **Holds** (``version_holds.py``) keep a multi-turn trajectory's version pinned between turns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from jax_dora.rollout.version_holds import VersionHolds
from jax_dora.rollout.version_store import LoadDecision, VersionStore
from jax_dora.snapshots import SnapshotIntegrityError, as_reader

_log = logging.getLogger(__name__)


class ServerVersions:
  """A server's held versions and their loading; the driver loop applies incarnation switches.

  ``wake``: the driver's condition (its lock guards ``switch_to``);
  ``check_alive``: raises once the driver is stopped (a waiting load gives up).
  """

  def __init__(self, snapshot_dir: Any, max_versions: int, name: str, hold_timeout_s: float,
               load_fn: Callable[[int, str | None], Any] | None, params_loader: Callable,
               wake: threading.Condition, check_alive: Callable[[], None]):
    self.name = name
    self.reader = as_reader(snapshot_dir)  # a directory, or a reader (in-memory transport)
    self.store = VersionStore(max_versions)
    self.holds = VersionHolds(hold_timeout_s, name)
    self._load_fn = load_fn or (lambda v, inc: params_loader(self.reader, v, inc))
    self._params_loader = params_loader
    # A pending version's params already fetched from a one-off source (a transfer offer).
    self._prefetched: tuple[int, Any] | None = None
    # The run incarnation whose versions this server holds (None: not known
    # yet, or snapshots without one).
    self.incarnation: str | None = None
    self.switch_to: str | None = None  # set under ``wake``'s lock; the loop applies it
    self._switched = threading.Event()
    self._wake = wake
    self._check_alive = check_alive
    self._load_lock = threading.Lock()
    self.integrity_failures = 0  # snapshot loads refused by their checksums

  def load_version(self, version: int, incarnation: str | None = None,
                   source: Any = None) -> None:
    """Loads snapshot ``version``; returns once loaded or recorded as pending.

    Idempotent. A version older than the newest held one is ignored (new
    requests would not use it). ``incarnation`` names the run incarnation the
    version belongs to (the snapshot's metadata must agree); if it differs
    from the one held, the driver loop first drops every held version and
    fails their requests with :class:`api.IncarnationMismatchError`. ``None``
    keeps the current incarnation, or adopts the snapshot's own on the first load.

    ``source``: a reader for this load only (a pulled transfer offer,
    ``snapshots/transfer.py``); a version that must wait for room is fetched
    from it at once and kept until it is loaded.

    Raises:
      SnapshotNotFoundError / SnapshotCorruptError: from the snapshot reader
        (also for a snapshot of another incarnation than ``incarnation``).
      RolloutError: the driver is stopped.
    """
    version = int(version)
    self._check_alive()
    with self._load_lock:
      if incarnation is None:
        incarnation = self.incarnation
        if incarnation is None:
          incarnation = (source or self.reader).read_metadata(version).get("incarnation")
      if incarnation != self.incarnation:
        self._switch(incarnation)
      decision = self.store.begin_load(version)
      if decision is LoadDecision.LOAD:
        self._load(version, source)
      elif decision is LoadDecision.PENDING:
        if source is not None:  # an offer is pulled now; the params wait with the version
          self._prefetched = (version, self._load_from(source, version))
        # Fail fast on a version that does not exist instead of leaving it pending forever.
        elif not self.reader.has_version(version):
          self.reader.load(version)  # raises SnapshotNotFoundError with the path
        _log.info("%s: version %d pending (no room among %d held versions: older ones still"
                  " pinned)", self.name, version, self.store.max_versions)
    with self._wake:
      self._wake.notify_all()

  def _switch(self, incarnation: str | None) -> None:
    """Has the driver loop drop every version and request of the old incarnation."""
    with self._wake:
      self._switched.clear()
      self.switch_to = incarnation
      self._wake.notify_all()
    while not self._switched.wait(timeout=0.5):
      self._check_alive()
    _log.info("%s: now serving run incarnation %s", self.name, incarnation)

  def reset(self, incarnation: str | None) -> None:
    """Loop thread: a fresh store and no holds for ``incarnation`` (the old pins go with
    the old store); wakes the waiting :meth:`load_version`."""
    peak = self.store.peak_loaded
    self.holds.forget()
    self.store = VersionStore(self.store.max_versions)
    self.store.peak_loaded = peak
    self.incarnation = incarnation
    self._switched.set()

  def _load_from(self, source: Any, version: int) -> Any:
    return self._params_loader(source, version, self.incarnation)

  def _load(self, version: int, source: Any = None) -> None:
    try:
      if source is not None:
        params = self._load_from(source, version)
      elif self._prefetched is not None and self._prefetched[0] == version:
        params = self._prefetched[1]
      else:
        params = self._load_fn(version, self.incarnation)
      if self._prefetched is not None and self._prefetched[0] <= version:
        self._prefetched = None
    except BaseException as e:
      self.store.abort_load(version)
      if isinstance(e, SnapshotIntegrityError):
        self.integrity_failures += 1
        _log.error("%s: %s", self.name, e)
      raise
    self.store.finish_load(version, params)
    _log.debug("%s: loaded version %d (held: %s)", self.name, version, self.store.loaded)

  def load_pending(self) -> None:
    """Loop thread: loads a pending version once a slot has freed room."""
    if self.store.pending is None or not self._load_lock.acquire(blocking=False):
      return
    try:
      version = self.store.take_pending()
      if version is not None:
        try:
          self._load(version)
        except Exception as e:  # pylint: disable=broad-exception-caught
          # Admission goes on with what is held; the orchestrator offers a newer version soon.
          _log.error("%s: loading pending version %d failed: %s", self.name, version, e)
    finally:
      self._load_lock.release()
