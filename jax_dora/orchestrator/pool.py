"""The pool where finished trajectories wait until their GRPO group is complete.

GRPO advantages are normalised within a group, so the learner may only consume
whole groups of ``group_size`` trajectories of one prompt. Trajectories stream
in one at a time, in any order, from any server; the pool assembles them and
hands out complete groups in the order they *completed* (FIFO), so the oldest
trainable data is consumed first and waiting staleness stays low.

The pool is also the first line of the data-integrity defence:

* every key ``(sample_id, member)`` it ever saw is remembered, so a duplicate
  (a trajectory produced twice, or re-added after training) raises instead of
  being trained twice;
* nothing leaves the pool silently: groups go out through :meth:`pop_groups`
  (to the learner), :meth:`evict_stale` (reason ``"stale"``) or :meth:`remove`
  (e.g. PACE, reason given by the caller), and evictions/removals are recorded
  in :attr:`removals` for the caller to log and re-queue.

Only *complete* groups are ever evicted or removed. A stale incomplete group
still has members in flight; dropping its finished members now would let the
in-flight ones arrive later as a half group of a prompt that was already
re-queued. Because versions only grow, such a group is evicted as soon as it
completes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

from jax_dora.orchestrator import staleness as staleness_lib
from jax_dora.types import Trajectory

Group = list[Trajectory]

# Key states in the pool's ledger of every key it ever saw.
_POOLED = "pooled"  # waiting in the pool (partial or complete group)
_CONSUMED = "consumed"  # handed to the learner; may never come back
_RELEASED = "released"  # evicted/removed; may be regenerated and re-added


class DuplicateTrajectoryError(ValueError):
  """A key was added while already pooled, or after it was handed to the learner."""


@dataclasses.dataclass(frozen=True)
class Removal:
  """Why a complete group left the pool without being trained."""

  sample_id: int
  reason: str  # "stale" | caller-given, e.g. "pace"
  version: int  # learner version at removal (-1 if the caller gave none)
  behaviour_staleness: int  # worst member behaviour staleness at removal (-1 if unknown)


@dataclasses.dataclass
class PopResult:
  """What :meth:`TrajectoryPool.pop_batch` returns."""

  groups: list[Group]
  evicted: list[Group]


class TrajectoryPool:
  """Assembles finished trajectories into GRPO groups and serves them FIFO."""

  def __init__(self, group_size: int, max_staleness: int | None = None):
    """Creates an empty pool.

    Args:
      group_size: ``G``, trajectories per prompt; members are ``0..G-1``.
      max_staleness: hard bound on behaviour staleness at consumption; groups
        exceeding it are evicted. ``None`` disables eviction (sync modes).
    """
    if group_size < 1:
      raise ValueError(f"group_size must be >= 1, got {group_size}")
    self.group_size = int(group_size)
    self.max_staleness = None if max_staleness is None else int(max_staleness)
    self._partial: dict[int, dict[int, Trajectory]] = {}
    # sample_id -> group, in order of completion.
    self._complete: collections.OrderedDict[int, Group] = collections.OrderedDict()
    self._key_state: dict[tuple[int, int], str] = {}
    self._num_trajectories = 0
    self.removals: list[Removal] = []

  # ------------------------------------------------------------------ adding
  def add(self, traj: Trajectory, version: int | None = None) -> bool:
    """Adds a finished trajectory; returns True if it completed its group.

    Args:
      traj: a finished (not ``"aborted"``) trajectory.
      version: newest published version when it arrives; fills
        ``traj.finish_version`` if the caller has not set it, so waiting
        staleness is always defined for pooled trajectories.

    Raises:
      DuplicateTrajectoryError: the key is already pooled or was consumed.
      ValueError: the trajectory is aborted, or its member index is out of range.
    """
    if traj.finish_reason == "aborted":
      raise ValueError(f"trajectory {traj.key} is aborted; only finished ones enter the pool")
    if not 0 <= traj.member < self.group_size:
      raise ValueError(
          f"member {traj.member} of sample {traj.sample_id} outside [0, {self.group_size})"
      )
    key = traj.key
    state = self._key_state.get(key)
    if state == _POOLED:
      raise DuplicateTrajectoryError(f"trajectory {key} is already in the pool")
    if state == _CONSUMED:
      raise DuplicateTrajectoryError(f"trajectory {key} was already handed to the learner")
    if traj.finish_version < 0:
      if version is None:
        raise ValueError(f"trajectory {key} has no finish_version and no version was given")
      traj.finish_version = int(version)
    members = self._partial.setdefault(traj.sample_id, {})
    members[traj.member] = traj
    self._key_state[key] = _POOLED
    self._num_trajectories += 1
    if len(members) < self.group_size:
      return False
    del self._partial[traj.sample_id]
    self._complete[traj.sample_id] = [members[m] for m in range(self.group_size)]
    return True

  # ---------------------------------------------------------------- queries
  def occupancy(self) -> int:
    """Complete groups waiting: the consumable backlog PACE controls."""
    return len(self._complete)

  def num_complete_groups(self) -> int:
    return len(self._complete)

  def num_trajectories(self) -> int:
    """Trajectories held, in complete and partial groups (for producer back-pressure)."""
    return self._num_trajectories

  def __len__(self) -> int:
    return self._num_trajectories

  def complete_groups(self) -> list[Group]:
    """Complete groups in FIFO order of completion (copies of the lists)."""
    return [list(g) for g in self._complete.values()]

  # ---------------------------------------------------------------- leaving
  def _take(self, sample_id: int, new_state: str) -> Group:
    group = self._complete.pop(sample_id)
    for t in group:
      self._key_state[t.key] = new_state
    self._num_trajectories -= len(group)
    return group

  def evict_stale(self, learner_version: int) -> list[Group]:
    """Removes complete groups whose worst member exceeds ``max_staleness``.

    Returns the evicted groups (FIFO order) so the caller can record them and
    re-queue their prompts; each is also appended to :attr:`removals`.
    """
    if self.max_staleness is None:
      return []
    evicted = []
    for sid, group in list(self._complete.items()):
      worst = staleness_lib.group_behaviour_staleness(group, learner_version)
      if worst > self.max_staleness:
        evicted.append(self._take(sid, _RELEASED))
        self.removals.append(Removal(sid, "stale", int(learner_version), worst))
    return evicted

  def remove(
      self, groups: Iterable[Sequence[Trajectory]], reason: str = "rejected",
      version: int | None = None,
  ) -> None:
    """Removes specific complete groups (e.g. PACE rejections) for regeneration.

    Raises:
      KeyError: a group is not a complete group currently in the pool; nothing
        is removed in that case, so the pool never ends half-updated.
    """
    sids = [g[0].sample_id for g in groups]
    missing = [s for s in sids if s not in self._complete]
    if missing or len(set(sids)) != len(sids):
      raise KeyError(f"not complete groups in the pool (or repeated): {missing or sids}")
    for sid in sids:
      group = self._take(sid, _RELEASED)
      worst = (
          staleness_lib.group_behaviour_staleness(group, version) if version is not None else -1
      )
      self.removals.append(Removal(sid, reason, -1 if version is None else int(version), worst))

  def pop_groups(self, num_groups: int) -> list[Group]:
    """Hands the ``num_groups`` oldest complete groups to the learner.

    Raises:
      ValueError: fewer complete groups are available; a short batch would
        silently change the effective batch size.
    """
    if num_groups > len(self._complete):
      raise ValueError(f"asked for {num_groups} groups, only {len(self._complete)} complete")
    return [self._take(sid, _CONSUMED) for sid in list(self._complete)[:num_groups]]

  def pop_batch(self, num_groups: int, learner_version: int) -> PopResult:
    """Evicts stale groups, then pops ``num_groups`` groups if that many remain.

    Returns:
      ``PopResult(groups, evicted)``: ``groups`` is empty when fewer than
      ``num_groups`` complete groups remain after eviction (nothing is popped);
      ``evicted`` always lists what was evicted by this call.
    """
    evicted = self.evict_stale(learner_version)
    if len(self._complete) < num_groups:
      return PopResult([], evicted)
    return PopResult(self.pop_groups(num_groups), evicted)
