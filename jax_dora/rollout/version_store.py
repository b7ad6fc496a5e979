"""Ref-counted policy versions on one rollout server, capped at ``max_versions``.

DORA keeps old trajectories decoding on the version that started them while
new requests start on the newest version. Each version's params cost a full
copy of the model in accelerator memory, so the server holds at most
``max_versions`` of them, and frees a version as soon as no slot is pinned to
it and it is not the newest (nobody new will ever ask for it).

**The cap is hard.** When a new version arrives while the server is full and
every held version but the newest is still pinned by a running slot (the
newest is kept regardless, see below), we do *not* load it (that would exceed
the cap) and we do not preempt running slots (that would throw away work, and
DORA's point is not to). Instead the version becomes
*pending* and is loaded as soon as the oldest version's last slot finishes.
Meanwhile new requests keep being admitted on the newest *held* version, so
slots never idle behind a long-tailed rollout (exactly what happens in the
window between a publish and its load anyway; the staleness bound still
applies to every trajectory). New pins only ever go to the newest held
version, never to the older ones, so their refcounts only fall and the
pending version always gets its room. With ``max_versions=1`` that argument
fails (the one held version is the one being pinned), so admission stops
while a version is pending or loading.

If several versions arrive while one is pending, only the latest is kept
pending: an intermediate version would be superseded before any request could
use it.

**Invariant: new requests never move back to an older version.** Making room
never evicts the newest held version (not even an unpinned one) while
``max_versions >= 2``: the incoming version becomes pending instead and is
loaded once an older version's last slot releases (the caller retries
:meth:`take_pending`, e.g. the driver loop's ``_maybe_load_pending``). So
:attr:`newest` is always the highest loaded version, never decreases, and
``acquire(None)`` always returns it. With ``max_versions=1`` the one held
version *is* the newest: once unpinned it is freed to make room for the next,
and while that loads :attr:`newest` is ``None`` (``acquire(None)`` raises
:class:`VersionUnavailableError`; admission was already paused), never an
older version. A version older than one that has already been the newest is
never loaded again.

Loading itself is done by the caller (I/O, not bookkeeping); this class only
decides and records. Protocol: :meth:`begin_load` -> (load params) ->
:meth:`finish_load` or :meth:`abort_load`. While a load is in progress its
reserved room counts toward :attr:`num_loaded` (and with ``max_versions=1``
admission is paused), so the cap holds even while the new params are being
materialised.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

from jax_dora.rollout.api import VersionUnavailableError

Params = Any


class LoadDecision(enum.Enum):
  LOADED = "loaded"  # already held (or older than what we hold): nothing to do
  LOAD = "load"  # room reserved: caller loads now and calls finish_load
  PENDING = "pending"  # no room: recorded as pending


class VersionStore:
  """Thread-safe bookkeeping of held param versions and slot pins."""

  def __init__(self, max_versions: int):
    if max_versions < 1:
      raise ValueError(f"max_versions must be >= 1, got {max_versions}")
    self.max_versions = int(max_versions)
    self._lock = threading.RLock()
    self._params: dict[int, Params] = {}
    self._refs: dict[int, int] = {}
    self._newest: int | None = None
    self._newest_ever: int | None = None  # highest version that has been newest
    self._pending: int | None = None
    self._loading: int | None = None
    self.peak_loaded = 0  # max num_loaded ever observed (tests, metrics)

  # -------------------------------------------------------------- inspection
  @property
  def newest(self) -> int | None:
    with self._lock:
      return self._newest

  @property
  def pending(self) -> int | None:
    with self._lock:
      return self._pending

  @property
  def loading(self) -> int | None:
    with self._lock:
      return self._loading

  @property
  def loaded(self) -> tuple[int, ...]:
    with self._lock:
      return tuple(sorted(self._params))

  @property
  def num_loaded(self) -> int:
    """Param sets in memory, counting one being loaded right now."""
    with self._lock:
      return len(self._params) + (self._loading is not None)

  @property
  def admitting(self) -> bool:
    """Whether new requests may be admitted now (see the module docstring)."""
    with self._lock:
      if self._newest is None:
        return False
      return self.max_versions > 1 or (self._pending is None and self._loading is None)

  def refcount(self, version: int) -> int:
    with self._lock:
      return self._refs.get(version, 0)

  def params(self, version: int) -> Params:
    with self._lock:
      try:
        return self._params[version]
      except KeyError:
        raise VersionUnavailableError(
            f"policy version {version} is not loaded (loaded: {sorted(self._params)})"
        ) from None

  def snapshot(self) -> dict[int, Params]:
    """A copy of version -> params (for one ``generate`` call)."""
    with self._lock:
      return dict(self._params)

  def is_loaded(self, version: int) -> bool:
    with self._lock:
      return version in self._params

  # ----------------------------------------------------------------- loading
  def _make_room_locked(self, incoming: int) -> bool:
    """Frees unpinned versions superseded by ``incoming``; True if one fits.

    Never frees the newest version while ``max_versions >= 2`` (new requests
    start on it; freeing it would send them back to an older pinned one).
    """
    for v in sorted(self._params):
      if len(self._params) < self.max_versions:
        break
      if v == self._newest and self.max_versions > 1:
        continue
      if self._refs.get(v, 0) == 0 and v < incoming:
        self._free_locked(v)
    return len(self._params) < self.max_versions

  def begin_load(self, version: int) -> LoadDecision:
    """Decides what to do with a newly offered ``version``."""
    version = int(version)
    with self._lock:
      if version in self._params or version == self._loading:
        return LoadDecision.LOADED
      if self._newest_ever is not None and version < self._newest_ever:
        # New requests would never use it, and explicit requests for stale
        # versions are served only while a slot still pins them. (Checked
        # against the highest version ever newest: with max_versions=1 the
        # newest is None while its successor loads, and an aborted load must
        # not let an older version in.)
        return LoadDecision.LOADED
      if self._loading is not None:
        raise RuntimeError(f"version {self._loading} is still loading; loads must be serialized")
      if self._make_room_locked(version):
        self._loading = version
        if self._pending is not None and self._pending <= version:
          self._pending = None
        self._note_peak_locked()
        return LoadDecision.LOAD
      if self._pending is None or version > self._pending:
        self._pending = version
      return LoadDecision.PENDING

  def take_pending(self) -> int | None:
    """If a pending version now fits, reserves room for it and returns it."""
    with self._lock:
      if self._pending is None or self._loading is not None:
        return None
      if not self._make_room_locked(self._pending):
        return None
      self._loading, self._pending = self._pending, None
      self._note_peak_locked()
      return self._loading

  def finish_load(self, version: int, params: Params) -> None:
    with self._lock:
      if self._loading != version:
        raise RuntimeError(f"finish_load({version}) but loading {self._loading}")
      self._loading = None
      self._params[version] = params
      self._refs.setdefault(version, 0)
      if self._newest is None or version > self._newest:
        old, self._newest = self._newest, version
        if self._newest_ever is None or version > self._newest_ever:
          self._newest_ever = version
        if old is not None and self._refs.get(old, 0) == 0:
          self._free_locked(old)
      self._note_peak_locked()

  def abort_load(self, version: int) -> None:
    """The load of ``version`` failed: give its reserved room back."""
    with self._lock:
      if self._loading == version:
        self._loading = None

  # ------------------------------------------------------------ slot pinning
  def acquire(self, version: int | None = None) -> int:
    """Pins one slot to ``version`` (``None`` = newest); returns the version.

    Raises:
      VersionUnavailableError: the version is not loaded (or none is).
    """
    with self._lock:
      if version is None:
        if self._newest is None:
          raise VersionUnavailableError("no policy version loaded yet")
        version = self._newest
      if version not in self._params:
        raise VersionUnavailableError(
            f"policy version {version} is not loaded (loaded: {sorted(self._params)})"
        )
      self._refs[version] = self._refs.get(version, 0) + 1
      return version

  def release(self, version: int) -> None:
    """Unpins one slot; frees the version if unused and not the newest."""
    with self._lock:
      n = self._refs.get(version, 0)
      if n <= 0:
        raise RuntimeError(f"release({version}) without a matching acquire")
      self._refs[version] = n - 1
      if n == 1 and version != self._newest:
        self._free_locked(version)

  # ----------------------------------------------------------------- helpers
  def _free_locked(self, version: int) -> None:
    self._params.pop(version, None)
    self._refs.pop(version, None)
    if version == self._newest:
      # Only with max_versions=1 (see _make_room_locked), so nothing else is
      # held; never fall back to an older version.
      self._newest = None

  def _note_peak_locked(self) -> None:
    self.peak_loaded = max(self.peak_loaded, len(self._params) + (self._loading is not None))
