"""The learner's half of snapshot integrity: published versions checked against its own params.

A server verifies the tree it restored against the checksums in the
version's metadata (``SnapshotReader``); that proves the file is what the
publisher was handed, not that the publisher was handed the learner's
parameters at that version (a wrong copy, a stale buffer, a background
write racing the next donating step). So, for every ``every``-th version,
the orchestrator takes the checksums of the learner's live parameters right
after the step that made them (before the next step can donate them) and,
once the version is written, compares them with what was published. A
difference is an integrity violation in the ledger (issue 28).

Cost: one read of the parameters on the learner's devices per checked
version. Skipped under multi-process learners, where a program over the
global parameters would need every learner process to join it.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from jax_dora.snapshots import as_reader, checksum

log = logging.getLogger(__name__)


class SnapshotAudit:
  """Remembers the learner's checksums of chosen versions and checks them once published."""

  def __init__(self, directory: Any, every: int, cast: str | None = None):
    """``directory``: the snapshot directory or a reader; ``cast``: the dtype versions are
    written in (``snapshots.write_dtype``), which the learner's checksums are taken in."""
    self.every = int(every) if jax.process_count() == 1 else 0
    self.cast = cast or None
    self._reader = as_reader(directory, verify_checksums=False) if self.every else None
    self._own: dict[int, dict[str, checksum.LeafSum]] = {}
    self.checked = 0

  def wants(self, version: int) -> bool:
    return bool(self.every) and version % self.every == 0

  def remember(self, version: int, params: Any) -> None:
    """The learner's checksums at ``version`` (call before the next step)."""
    if self.wants(version):
      self._own[version] = checksum.checksums(params, cast=self.cast)

  def check(self, version: int) -> str | None:
    """Compares a remembered version with its published record; the problem, or None."""
    own = self._own.pop(version, None)
    for old in [v for v in self._own if v < version]:
      del self._own[old]  # coalesced away by the background publisher: never written
    if own is None:
      return None
    tables = self._reader.read_metadata(version).get("checksums")
    if not tables:
      return "the published version carries no checksums"
    self.checked += 1
    problem, _ = checksum.first_mismatch(own, {"published": tables.get("published", {})})
    if problem is not None:
      log.error("snapshot version %d differs from the learner's parameters: %s", version, problem)
    return problem
