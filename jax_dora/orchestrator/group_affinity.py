"""Where a GRPO group's members go: the server its first member went to, while it has room.

Why: a rollout server prefills a group's shared prompt once for the members it
admits together (``share_prompt_prefill``). Routing each request to the least
loaded server spread a group of 8 over two servers 4/4, so the prompt was
prefilled on both (README: 8.0x prompt sharing on one engine, 1.5x over two
servers). Keeping a group on its *home* server while that server has a free
slot keeps the sharing; groups still spread across servers, because each new
group's home is the least-loaded server. When the home is full, down or the
one a request just failed on, the member falls back to least-loaded routing
and the fallback is counted.

Pure bookkeeping: :class:`jax_dora.orchestrator.dispatch.Dispatcher` owns the
servers and asks this object which one a member should prefer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Generic, TypeVar

_S = TypeVar("_S")


@dataclasses.dataclass
class _Home(Generic[_S]):
  server: _S
  members_in_flight: int = 0


class GroupAffinity(Generic[_S]):
  """Group key -> home server, kept while any of the group's requests is in flight."""

  def __init__(self):
    self._homes: dict[Hashable, _Home[_S]] = {}
    self.kept = 0  # members routed to their group's home
    self.fell_back = 0  # members whose home had no room (or was unusable)

  def home(self, group: Hashable | None) -> _S | None:
    """The server ``group``'s earlier members went to (None: no member in flight)."""
    h = self._homes.get(group)  # None is never a key: started() ignores it
    return h.server if h is not None else None

  def started(self, group: Hashable | None, server: _S) -> None:
    """A member of ``group`` was sent to ``server``: counts it; the first one sets the home."""
    if group is None:
      return
    h = self._homes.get(group)
    if h is None:
      self._homes[group] = _Home(server, 1)
      return
    if h.server is server:
      self.kept += 1
    else:
      self.fell_back += 1
    h.members_in_flight += 1

  def finished(self, group: Hashable | None) -> None:
    """A member's request ended; the home is forgotten with the group's last one."""
    h = self._homes.get(group)
    if h is None:
      return
    h.members_in_flight -= 1
    if h.members_in_flight <= 0:
      del self._homes[group]

  def counts(self) -> dict[str, int]:
    """Cumulative counters (for the step record)."""
    return {"dispatch/group_affinity_kept_total": self.kept,
            "dispatch/group_affinity_fallbacks_total": self.fell_back}
