"""How stale a trajectory is, measured in policy versions.

Staleness has two sources that call for different remedies, so we measure
them separately:

* *generation staleness*: versions published while the trajectory was being
  generated. It grows with rollout length (a long answer simply takes more
  learner steps to sample), so it says little about whether the sample is
  "bad"; rejecting on it would bias training against long answers.
* *waiting staleness*: versions published while the finished trajectory sat in
  the pool. This is pure queueing delay that the orchestrator controls (PACE
  acts on it).

Their sum is the *effective staleness* reported in metrics. The hard bound of
the DORA constraints uses *behaviour staleness* instead: the distance from the
learner to the oldest policy that sampled any token, because that is what the
importance ratios have to correct.

Trajectories resumed after an interruption carry several spans. Their
generation staleness is token-weighted (prefix-aware): each span's tokens count
the versions from that span's version to the finish, so a long prefix sampled
long ago weighs more than a short suffix sampled just now.

Multi-turn trajectories (tool calls) are the same sum over their *sampled*
spans (observations are context, no version sampled them), so the versions
published while a tool ran count for every token sampled before the call:
a turn's tokens wait through every later tool call. That part is
:func:`tool_wait_staleness`: ``sum_c dv_c * L_before_c / L`` over calls ``c``
(``dv_c`` versions published during the call, ``L_before_c`` sampled tokens
before it, ``L`` all sampled tokens). It is wall time the policy spent in the
environment, not in generation, so PACE explains it away like the length
term (``pace.unexplained_generation_staleness``): a trajectory is not
rejected for having called a slow tool.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax_dora.types import Trajectory


def _require_finished(traj: Trajectory) -> None:
  if traj.finish_version < 0:
    raise ValueError(
        f"trajectory {traj.key} has no finish_version; staleness is only defined"
        " for finished trajectories (the orchestrator sets it at finish)"
    )


def generation_staleness(traj: Trajectory, version_at_finish: int | None = None) -> float:
  """Token-weighted versions elapsed between sampling and finishing.

  Args:
    traj: a trajectory with ``spans`` (or, lacking spans, ``start_version``).
    version_at_finish: newest published version when it finished; defaults to
      ``traj.finish_version``.

  Returns:
    ``sum_s len(s) * (version_at_finish - s.version) / sum_s len(s)``, clipped at
    zero per span (a span can never be sampled by a version newer than the
    finish; a negative value would only hide a clock mismatch in metrics, and
    the integrity ledger reports such spans separately). For a single-span
    trajectory this is exactly ``finish - start`` in versions. With no
    completion tokens it falls back to the version the request started on.
  """
  if version_at_finish is None:
    _require_finished(traj)
    version_at_finish = traj.finish_version
  weighted = 0
  tokens = 0
  for s in traj.spans:
    n = max(0, s.end - s.start)
    weighted += n * max(0, version_at_finish - s.version)
    tokens += n
  if tokens == 0:
    start = traj.oldest_version
    return float(max(0, version_at_finish - start)) if start >= 0 else 0.0
  return weighted / tokens


def waiting_staleness(traj: Trajectory, current_version: int) -> int:
  """Versions published since the trajectory finished (time spent in the pool)."""
  _require_finished(traj)
  return max(0, int(current_version) - int(traj.finish_version))


def effective_staleness(
    traj: Trajectory,
    current_version: int,
    *,
    generation_weight: float = 1.0,
    waiting_weight: float = 1.0,
) -> float:
  """Weighted sum of generation and waiting staleness.

  With unit weights and a single span this equals ``current - start`` (the
  behaviour staleness); with resumed rollouts it is smaller, because only the
  tokens of the old prefix are that old.
  """
  return generation_weight * generation_staleness(traj) + waiting_weight * waiting_staleness(
      traj, current_version
  )


def behaviour_staleness(traj: Trajectory, learner_version: int) -> int:
  """``learner_version - oldest span version``: the quantity the hard bound limits."""
  return int(learner_version) - int(traj.oldest_version)


def group_completion_version(group: Sequence[Trajectory]) -> int:
  """Version at which the last member finished, i.e. the group became trainable."""
  for t in group:
    _require_finished(t)
  return max(int(t.finish_version) for t in group)


def group_waiting_staleness(group: Sequence[Trajectory], current_version: int) -> int:
  """Versions a *complete* group has waited in the pool.

  Members that finish early also wait for their slowest sibling; that part is
  caused by the sibling's length, not by the pool, so it is excluded here (PACE
  would otherwise penalise every group that contains a long answer).
  """
  return max(0, int(current_version) - group_completion_version(group))


def group_behaviour_staleness(group: Sequence[Trajectory], learner_version: int) -> int:
  """Worst member behaviour staleness: a group is trainable only if all members are."""
  return max(behaviour_staleness(t, learner_version) for t in group)


def tool_wait_staleness(traj: Trajectory) -> float:
  """Token-weighted versions published while the trajectory's tools ran (see module doc)."""
  sampled = traj.num_sampled_tokens
  if not traj.tool_calls or sampled <= 0:
    return 0.0
  mask = traj.sampled_mask()
  total = 0.0
  for call in traj.tool_calls:
    waited = max(0, int(call.get("version_end", 0)) - int(call.get("version_start", 0)))
    total += waited * int(mask[:int(call["start"])].sum())
  return total / sampled
