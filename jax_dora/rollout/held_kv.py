"""Held KV: a multi-turn trajectory's cache entries kept on its server while its tool runs.

A turn that ends at a tool call (``finish_reason="stop"`` with a ``hold``)
leaves its context's keys/values in a decode slot that the next admission
round will overwrite. Without this table the next turn prefills the whole
context again (prompt + every turn so far + the observation): quadratic in
turns. Here the slot's entries are copied into a row of a separate pool
(``DeviceSteps.park``) and the next turn of the same hold, on the same
version, gets them back and prefills only its new tokens
(``DeviceSteps.extend_batch``), the way vLLM's and SGLang's prefix caches
serve a multi-turn conversation, keyed by the hold instead of a token hash
(the hold already names the trajectory and pins the version that computed the
entries).

Why a pool and not the slot itself: a parked slot would take a decode slot
out of service for the whole tool call; a pool row costs memory (one cache
row of ``max_seq_len`` entries each, ``rollout.held_kv_slots`` of them)
and two copies of the used prefix per turn, and keeps every decode slot busy.

Bounded and counted: when the pool is full the least recently parked entry is
dropped; an entry is dropped when its hold is released (abort, timeout, a
retired incarnation); a turn whose entry is gone, was computed by another
version than the one it runs on (a per-turn version hop), does not match its
context token for token, or whose new part is longer than the resume
programs take, re-prefills as before. Every such turn is counted by reason.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

# Why a held turn re-prefilled instead of resuming from its held entries.
FALLBACKS = ("not_held", "evicted", "version", "mismatch", "too_long")


@dataclasses.dataclass(frozen=True)
class HeldContext:
  """Pool row ``pool_row`` holds the entries of ``tokens`` (prompt + completion so far,
  less the last sampled token, whose entry a decode step may not have written),
  computed by ``version``."""

  pool_row: int
  version: int
  tokens: np.ndarray


@dataclasses.dataclass
class HeldKVCounters:
  """Since the server started (the step records take deltas)."""

  parked: int = 0  # turns whose entries went into the pool
  resumed: int = 0  # turns that prefilled only their new tokens
  reused_tokens: int = 0  # context tokens those turns did not prefill again
  fallbacks: dict[str, int] = dataclasses.field(
      default_factory=lambda: dict.fromkeys(FALLBACKS, 0))


class HeldKV:
  """Hold id -> :class:`HeldContext`, at most ``rows`` of them (least recently parked out)."""

  def __init__(self, rows: int):
    self.rows = int(rows)
    self._entries: collections.OrderedDict[str, HeldContext] = collections.OrderedDict()
    self._free = list(range(self.rows))
    self._evicted: set[str] = set()  # holds whose entry made room for another (a reason)
    self.counters = HeldKVCounters()

  def __len__(self) -> int:
    return len(self._entries)

  def __contains__(self, hold: str) -> bool:
    return hold in self._entries

  def holds(self) -> list[str]:
    return list(self._entries)

  def park(self, hold: str, version: int, tokens: np.ndarray) -> int:
    """Reserves a pool row for ``hold``'s context (replacing its older entry; evicting the
    least recently parked one when full) and returns it."""
    self.drop(hold)
    self._evicted.discard(hold)
    if not self._free:
      old, entry = self._entries.popitem(last=False)
      self._free.append(entry.pool_row)
      self._evicted.add(old)
    row = self._free.pop()
    self._entries[hold] = HeldContext(row, int(version), np.asarray(tokens, np.int32).copy())
    self.counters.parked += 1
    return row

  def resume(self, hold: str, version: int, context: np.ndarray, longest: int
             ) -> tuple[HeldContext | None, str]:
    """The held entry a new turn of ``hold`` on ``version`` with ``context`` can resume
    from, or ``(None, why not)``. The entry leaves the table either way (its row is
    returned with :meth:`release_row` once the resume has been issued)."""
    entry = self._entries.pop(hold, None)
    if entry is None:
      why = "evicted" if hold in self._evicted else "not_held"
      self._evicted.discard(hold)
      return None, self._fallback(why)
    n = len(entry.tokens)
    if entry.version != version:
      why = "version"
    elif len(context) <= n or not np.array_equal(context[:n], entry.tokens):
      why = "mismatch"
    elif len(context) - n > longest:
      why = "too_long"
    else:
      self.counters.resumed += 1
      self.counters.reused_tokens += n
      return entry, ""
    self._free.append(entry.pool_row)
    return None, self._fallback(why)

  def release_row(self, entry: HeldContext) -> None:
    """A resumed entry's row is free again (the resume that read it is already queued on
    the device ahead of any later park)."""
    self._free.append(entry.pool_row)

  def drop(self, hold: str) -> None:
    entry = self._entries.pop(hold, None)
    if entry is not None:
      self._free.append(entry.pool_row)

  def drop_unheld(self, live_holds) -> None:
    """Drops the entries whose hold was released (``live_holds``: the server's holds)."""
    for hold in [h for h in self._entries if h not in live_holds]:
      self.drop(hold)
    self._evicted = {h for h in self._evicted if h in live_holds}

  def clear(self) -> None:
    for hold in list(self._entries):
      self.drop(hold)
    self._evicted.clear()

  def _fallback(self, why: str) -> str:
    self.counters.fallbacks[why] += 1
    return why
