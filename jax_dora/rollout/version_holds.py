"""Version holds: a multi-turn trajectory keeps its version live on the server between turns.

When a request with a ``hold`` id ends (its turn stopped at a tool call), the
slot's pin on its version becomes the hold's: the version is not retired while
the caller runs the tool. The next turn with the same hold takes the pin over
(and runs on the held version); ``abort([hold])`` releases it, and so does the
hold timeout (its orchestrator is gone). Each hold keeps exactly one pin in the
:class:`~jax_dora.rollout.version_store.VersionStore`, except an unpinned hold
(``RolloutRequest.keep_version=False``, a per-turn version hop): it names the
trajectory's server-side state (its held cache entries) and pins nothing.
"""

from __future__ import annotations

import logging
import time

from jax_dora.rollout.version_store import VersionStore

_log = logging.getLogger(__name__)


class VersionHolds:
  """Hold id -> (version, monotonic time taken, pinned); released into ``store``."""

  def __init__(self, timeout_s: float, name: str = "server"):
    self.timeout_s = float(timeout_s)
    self.name = name
    self._holds: dict[str, tuple[int, float, bool]] = {}
    # What status() reports, rebuilt on every change (status() runs on other
    # threads and must not iterate the dict).
    self.held_versions: tuple[int, ...] = ()
    self._checked = 0.0

  def __contains__(self, hold: str) -> bool:
    return hold in self._holds

  def __bool__(self) -> bool:
    return bool(self._holds)

  def version_of(self, hold: str) -> int | None:
    """The version ``hold`` pins (None: no such hold, or it pins nothing)."""
    held = self._holds.get(hold) if hold else None
    return held[0] if held is not None and held[2] else None

  def take(self, hold: str, version: int, store: VersionStore, *, pin: bool = True) -> None:
    """The pin of a finished turn on ``version`` becomes ``hold``'s (replacing an older one);
    ``pin=False``: the turn's pin is released and the hold pins nothing."""
    self.release([hold], store)
    if not pin:
      store.release(int(version))
    self._holds[hold] = (int(version), time.monotonic(), bool(pin))
    self._refresh()

  def release(self, holds: list[str], store: VersionStore) -> None:
    for h in holds:
      held = self._holds.pop(h, None)
      if held is not None and held[2]:
        store.release(held[0])
    self._refresh()

  def release_all(self, store: VersionStore) -> None:
    self.release(list(self._holds), store)

  def forget(self) -> None:
    """Drops every hold without releasing pins (their store is being discarded)."""
    self._holds.clear()
    self._refresh()

  def due_for_check(self) -> bool:
    return bool(self._holds) and time.monotonic() - self._checked >= 1.0

  def expire(self, store: VersionStore) -> None:
    """Releases holds older than ``timeout_s`` (checked about once a second)."""
    if not self.due_for_check():
      return
    now = self._checked = time.monotonic()
    old = [h for h, (_, since, _) in self._holds.items() if now - since > self.timeout_s]
    if old:
      _log.warning("%s: releasing %d version hold(s) not taken over within %.0fs", self.name,
                   len(old), self.timeout_s)
      self.release(old, store)

  def _refresh(self) -> None:
    self.held_versions = tuple(sorted(v for v, _, pinned in self._holds.values() if pinned))
