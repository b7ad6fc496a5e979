"""PACE: Pool-Aware Control of Effective Staleness.

When rollout servers produce faster than the learner consumes, complete groups
pile up in the pool and every one of them grows staler with each learner step.
Training on all of them keeps the learner on ever older data; the hard bound
only throws data away once it is already too old. PACE instead watches the
*excess* pool occupancy and rejects a few of the stalest complete groups early,
so the pool stays near a target and the data trained on stays fresh.

Budget (groups rejected per learner version)
--------------------------------------------
``excess = occupancy - target_pool_groups`` where occupancy counts complete
groups (optionally excluding ``reserve_groups``, the next batch).
``raw = gain * max(excess, 0)`` is smoothed across versions,
``ema_v = smoothing * ema_{v-1} + (1 - smoothing) * raw``, and

``budget = 0`` if ``excess <= 0``, else
``min(clip(round(ema_v), min_budget, max_budget), excess)``, where ``ema_v``
is the largest smoothed value seen during version ``v`` and ``excess`` counts
groups already rejected in ``v`` (each call rejects at most the current excess
and what is left of the version's budget).

So PACE never rejects while the pool is at or below target, never rejects the
pool below target, and at most ``max_budget`` groups per version. The budget is
per *version*: the orchestrator asks on every pool change, but a version's
rejections are counted against one budget, which is what makes ``gain`` a rate
(groups per learner step per group of excess) rather than "empty the excess on
the next arrival". Smoothing keeps one burst of arrivals from causing a burst
of rejections.

Score (which groups)
--------------------
Rejecting on raw effective staleness would mostly reject long answers: a
rollout of ``L`` tokens spans about ``k * L`` published versions just because
it is long (``k`` = versions per generated token). That biases GRPO toward
short answers on exactly the long-tailed tasks where async rollout pays off.
Length is not the only thing every rollout pays, though: admission, prefill
and the trip back to the pool take a fixed time, and while the learner
publishes several versions a second that latency alone spans versions (on
the long-tail benchmark a 1-3 token rollout spans ~3 versions, as many as a
16-token one). A reference that only scales with length leaves all of it
"unexplained" for short rollouts, and PACE then rejects short groups: the
same length bias the other way round (README, PACE's knobs). So the
reference is affine, ``a + k * L``, and PACE scores a complete group as::

  score = waiting_weight    * (v_now - v_complete)
        + generation_weight * mean_i max(0, g_i - (a + k * L_i) - generation_slack)

* ``v_now - v_complete``: versions the *complete* group has waited in the pool
  (queueing the orchestrator caused; a member's wait for its slow sibling is
  not counted, else groups with one long member would be penalised);
* ``g_i``: token-weighted generation staleness of member ``i``
  (:func:`staleness.generation_staleness`, prefix-aware for resumed rollouts,
  less the versions it spent waiting on tool calls);
* ``a + k * L_i`` is the part a typical rollout of that length spans
  (:func:`estimate_reference`), so only *unexplained* generation staleness
  (server stalls, queueing before admission) counts;
* ``k`` = ``versions_per_token`` if set; ``a`` = ``request_latency_versions``
  if >= 0. Left to estimate (0 and -1, the defaults), both are fitted to the
  candidate groups' members: ``k`` the least-squares slope of ``g`` on ``L``
  (clamped at 0; ``g`` counts whole versions, so a median of pairwise slopes
  is 0 on real pools), ``a`` the median of ``g - k * L`` (clamped at 0), a
  median so that the few stalled rollouts PACE exists to find do not set the
  latency they are measured against. With
  ``request_latency_versions = 0`` the reference is the length-only one of
  the first version, ``k = sum g / sum L``;
* ``generation_slack`` (versions) absorbs the discreteness of versions: any
  rollout, however short, may straddle one publish by bad luck.

Defaults weight waiting (1.0) above unexplained generation (0.5). A long
single-version rollout that generated at the reference rate thus scores only
its waiting time and is never ranked worse than a short one that has waited
longer. Ties are broken towards the older group (FIFO), which is closest to
the hard bound anyway.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
from collections.abc import Sequence
from typing import Any

from jax_dora.config.pace import ON_REJECT, PaceConfig  # noqa: F401  (re-exported)
from jax_dora.orchestrator import staleness as staleness_lib
from jax_dora.types import Trajectory

log = logging.getLogger(__name__)

Group = Sequence[Trajectory]


@dataclasses.dataclass(frozen=True)
class GroupScore:
  """A group's PACE score and the two terms it is made of."""

  score: float
  waiting: int  # versions the complete group has waited
  unexplained_generation: float  # mean over members, versions
  dominant: str  # "waiting" | "generation": the larger weighted term


@dataclasses.dataclass(frozen=True)
class GenerationReference:
  """The generation staleness a typical rollout of ``L`` sampled tokens spans:
  ``latency + rate * L`` versions."""

  latency: float  # ``a``: versions every request spans whatever its length
  rate: float  # ``k``: versions per sampled token

  def expected(self, tokens: int) -> float:
    return self.latency + self.rate * tokens


def rollout_generation_staleness(traj: Trajectory) -> float:
  """``g``: the trajectory's generation staleness less the versions it waited on tool calls
  (time in the environment, not in generation: PACE explains it away)."""
  return staleness_lib.generation_staleness(traj) - staleness_lib.tool_wait_staleness(traj)


def _generation_points(groups: Sequence[Group]) -> tuple[list[float], list[float]]:
  """``(L_i, g_i)`` of every member: sampled tokens and :func:`rollout_generation_staleness`."""
  lengths, gens = [], []
  for g in groups:
    for t in g:
      lengths.append(float(t.num_sampled_tokens))
      gens.append(rollout_generation_staleness(t))
  return lengths, gens


def _least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
  """Slope of ``y`` on ``x`` by least squares; 0 when every ``x`` is the same.

  Least squares, not a median of pairwise slopes (Theil-Sen): ``g`` counts whole versions,
  so most pairs of rollouts differ by 0 and the median slope is 0 even where long rollouts
  span more versions on average (measured on long_tail, 12-06: Theil-Sen fitted k = 0 and PACE
  then rejected groups averaging 35 tokens against 16 trained). The mean of ``g`` at a
  length is what grows with it. A few stalled rollouts pull this slope; the median latency
  keeps them from setting ``a``."""
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  var = sum((x - mx) ** 2 for x in xs)
  if var == 0:
    return 0.0
  return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def estimate_reference(groups: Sequence[Group], config: PaceConfig) -> GenerationReference:
  """``a + k * L`` for ``groups`` (the candidates): what is configured, the rest fitted
  (module docstring)."""
  lengths, gens = _generation_points(groups)
  if config.request_latency_versions >= 0:
    latency = config.request_latency_versions
    if config.versions_per_token > 0:
      return GenerationReference(latency, config.versions_per_token)
    tokens = sum(lengths)
    rate = (sum(gens) - latency * len(gens)) / tokens if tokens else 0.0
    return GenerationReference(latency, max(0.0, rate))
  if not lengths:
    return GenerationReference(0.0, config.versions_per_token)
  rate = config.versions_per_token or max(0.0, _least_squares_slope(lengths, gens))
  latency = max(0.0, statistics.median(g - rate * n for n, g in zip(lengths, gens)))
  return GenerationReference(latency, rate)


def unexplained_generation_staleness(
    traj: Trajectory, reference: GenerationReference, slack: float
) -> float:
  """Generation staleness beyond what a rollout of the trajectory's length spans (its tool
  calls' waits out)."""
  g = rollout_generation_staleness(traj)
  return max(0.0, g - reference.expected(traj.num_sampled_tokens) - slack)


def score_group(
    group: Group, current_version: int, config: PaceConfig, reference: GenerationReference
) -> GroupScore:
  """The PACE score of one complete group (higher = rejected first)."""
  waiting = staleness_lib.group_waiting_staleness(group, current_version)
  unexplained = sum(
      unexplained_generation_staleness(t, reference, config.generation_slack) for t in group
  ) / len(group)
  w_term = config.waiting_weight * waiting
  g_term = config.generation_weight * unexplained
  dominant = "waiting" if w_term >= g_term else "generation"
  return GroupScore(float(w_term + g_term), int(waiting), float(unexplained), dominant)


class PaceController:
  """Decides, on each pool change, which complete groups to reject."""

  def __init__(self, config: PaceConfig):
    self.config = config
    self._ema = 0.0  # smoothed raw budget of the previous version
    self._ema_current = 0.0  # largest smoothed value computed in this version
    self._version: int | None = None
    self._rejected_this_version = 0
    self.last_budget = 0
    self.last_excess = 0
    self.total_rejected = 0
    self.calls = 0
    self.last_reference = GenerationReference(0.0, 0.0)
    self.reasons: collections.Counter[str] = collections.Counter()

  def _advance(self, current_version: int) -> None:
    if self._version is None or current_version != self._version:
      if self._version is not None:
        self._ema = self._ema_current
      self._version = current_version
      self._ema_current = 0.0
      self._rejected_this_version = 0

  def budget(self, excess: int) -> int:
    """This version's budget given the current excess (updates smoothing).

    The smoothed value is the largest seen in the version, so the budget only
    grows while the version lasts (the pool filling up mid-version raises it;
    rejections draining the pool do not lower what was already granted).
    """
    c = self.config
    raw = c.gain * max(excess, 0)
    smoothed = c.smoothing * self._ema + (1.0 - c.smoothing) * raw
    self._ema_current = max(self._ema_current, smoothed)
    if excess <= 0:
      return 0
    b = int(math.floor(self._ema_current + 0.5))  # round half up
    return min(max(b, c.min_budget), c.max_budget, self._rejected_this_version + excess)

  def select_rejections(
      self, pool_groups: Any, current_version: int, *, reserve_groups: int = 0
  ) -> list[tuple[list[Trajectory], float, str]]:
    """Returns ``[(group, score, reason), ...]``, worst score first.

    Args:
      pool_groups: a :class:`TrajectoryPool` (its complete groups are used) or
        a sequence of complete groups in FIFO order.
      current_version: newest published policy version.
      reserve_groups: the first (oldest) complete groups that are about to be
        trained as the next batch; they are neither counted in occupancy nor
        candidates, so PACE only trims the backlog *beyond* the next batch.

    The caller removes the returned groups from the pool and records them; this
    method does not mutate the pool. ``reason`` is ``"pace_waiting"`` or
    ``"pace_generation"``, naming the term that dominated the score.
    """
    self.calls += 1
    self._advance(int(current_version))
    if hasattr(pool_groups, "complete_groups"):
      groups = pool_groups.complete_groups()
    else:
      groups = [list(g) for g in pool_groups]
    candidates = groups[max(0, reserve_groups):]
    excess = len(candidates) - self.config.target_pool_groups
    self.last_excess = excess
    budget = self.budget(excess)
    self.last_budget = budget
    n = max(0, min(budget - self._rejected_this_version, excess))
    if n == 0:
      return []
    ref = estimate_reference(candidates, self.config)
    self.last_reference = ref
    scored = [
        (score_group(g, current_version, self.config, ref), i, g)
        for i, g in enumerate(candidates)
    ]
    scored.sort(key=lambda x: (-x[0].score, x[1]))
    out = []
    for s, _, g in scored[:n]:
      reason = f"pace_{s.dominant}"
      out.append((g, s.score, reason))
      self.reasons[reason] += 1
    self._rejected_this_version += n
    self.total_rejected += n
    log.info(
        "PACE v%d: %d complete groups > target %d (excess %d), budget %d, reference"
        " %.2f + %.4f/token, rejecting %d %s",
        current_version, len(candidates), self.config.target_pool_groups, excess, budget,
        ref.latency, ref.rate, n, [(g[0].sample_id, round(sc, 2), r) for g, sc, r in out],
    )
    return out

  def stats(self) -> dict[str, Any]:
    """Counters for the metrics log."""
    return {
        "pace_budget": self.last_budget,
        "pace_excess": self.last_excess,
        "pace_rejected_total": self.total_rejected,
        "pace_calls": self.calls,
        # The generation reference of the last selection (a + k * L): what a rollout's
        # latency and length were taken to explain.
        "pace_reference_latency": self.last_reference.latency,
        "pace_reference_versions_per_token": self.last_reference.rate,
        **{f"pace_reason/{k}": v for k, v in sorted(self.reasons.items())},
    }
