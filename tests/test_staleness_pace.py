"""Staleness measures and PACE: budget, ranking, and no bias against long rollouts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _traj import make_group, make_traj
from jax_dora.config import base_config
from jax_dora.orchestrator import staleness as sl
from jax_dora.orchestrator.pace import (
    GenerationReference,
    PaceConfig,
    PaceController,
    estimate_reference,
    score_group,
)
from jax_dora.orchestrator.pool import TrajectoryPool

FAST = settings(max_examples=60, deadline=None)


# ------------------------------------------------------------------ staleness
def test_single_span_staleness_adds_up_to_behaviour_staleness():
  t = make_traj(0, 0, length=10, version=3, finish_version=5)
  assert sl.generation_staleness(t) == 2
  assert sl.generation_staleness(t, 7) == 4
  assert sl.waiting_staleness(t, 9) == 4
  assert sl.effective_staleness(t, 9) == 6 == sl.behaviour_staleness(t, 9)


def test_resumed_rollout_generation_staleness_is_token_weighted():
  # 30 tokens from v2, then resumed: 10 tokens from v4; finished at v5.
  t = make_traj(0, 0, spans=[(0, 30, 2), (30, 40, 4)], finish_version=5)
  assert sl.generation_staleness(t) == pytest.approx((30 * 3 + 10 * 1) / 40)
  assert sl.behaviour_staleness(t, 6) == 4  # oldest span bounds the importance ratio
  assert sl.effective_staleness(t, 6) == pytest.approx(2.5 + 1)


def test_staleness_needs_a_finished_trajectory():
  t = make_traj(0, 0)
  t.finish_version = -1
  with pytest.raises(ValueError, match="finish_version"):
    sl.waiting_staleness(t, 3)


@FAST
@given(
    cuts=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    v0=st.integers(0, 5),
    bumps=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    tail=st.integers(0, 3),
    wait=st.integers(0, 3),
)
def test_effective_never_exceeds_behaviour_staleness(cuts, v0, bumps, tail, wait):
  spans, pos, v = [], 0, v0
  for n, b in zip(cuts, bumps):
    spans.append((pos, pos + n, v))
    pos += n
    v += b
  finish = v + tail
  t = make_traj(0, 0, spans=spans, finish_version=finish)
  now = finish + wait
  assert 0 <= sl.effective_staleness(t, now) <= sl.behaviour_staleness(t, now)


def test_group_waiting_counts_from_group_completion():
  g = make_group(0, 3, version=0, finish_version=1)
  g[2].finish_version = 4  # the slow sibling
  assert sl.group_waiting_staleness(g, 5) == 1
  assert sl.group_behaviour_staleness(g, 5) == 5


# --------------------------------------------------------------------- config
def test_pace_config_from_base_config():
  c = PaceConfig.of(base_config().pace)
  assert c.target_pool_groups == 4 and c.on_reject == "regenerate"
  assert c.waiting_weight > c.generation_weight


def test_pace_config_rejects_typos_and_bad_values():
  cfg = base_config().pace
  d = cfg.to_dict()
  d["gian"] = 1.0
  with pytest.raises(ValueError, match="gian"):
    PaceConfig.of(d)
  with pytest.raises(ValueError, match="on_reject"):
    PaceConfig(on_reject="keep")
  with pytest.raises(ValueError, match="budget"):
    PaceConfig(min_budget=3, max_budget=1)


# ----------------------------------------------------------------------- PACE
def _pool_groups(draw_spec, group_size=2):
  """Complete groups from (length, start_version, gen_versions, wait_versions)."""
  groups = []
  now = max(v + gen + wait for _, v, gen, wait in draw_spec) if draw_spec else 0
  for sid, (length, v, gen, wait) in enumerate(draw_spec):
    # Wait is measured from "now", so lay finish versions out backwards.
    finish = now - wait
    start = min(v, finish)
    groups.append(make_group(sid, group_size, length=length, version=start, finish_version=finish))
  return groups, now


group_spec = st.tuples(
    st.integers(1, 300), st.integers(0, 5), st.integers(0, 6), st.integers(0, 6)
)
configs = st.builds(
    PaceConfig,
    target_pool_groups=st.integers(0, 6),
    gain=st.floats(0.0, 3.0),
    min_budget=st.integers(0, 2),
    max_budget=st.integers(2, 8),
    smoothing=st.just(0.0),
    generation_weight=st.floats(0.0, 2.0),
    waiting_weight=st.floats(0.0, 2.0),
)


@FAST
@given(cfg=configs, spec=st.lists(group_spec, max_size=8), data=st.data())
def test_pace_never_rejects_at_or_below_target(cfg, spec, data):
  spec = spec[: cfg.target_pool_groups]
  groups, now = _pool_groups(spec)
  ctl = PaceController(cfg)
  for v in range(now, now + data.draw(st.integers(1, 3))):
    assert ctl.select_rejections(groups, v) == []
  assert ctl.total_rejected == 0


def _expected_budget(cfg: PaceConfig, excess: int) -> int:
  if excess <= 0:
    return 0
  b = int(math.floor(cfg.gain * excess + 0.5))
  return min(max(b, cfg.min_budget), cfg.max_budget, excess)


@FAST
@given(cfg=configs, spec=st.lists(group_spec, min_size=1, max_size=14))
def test_pace_rejects_exactly_the_budget_and_the_worst_scores(cfg, spec):
  groups, now = _pool_groups(spec)
  excess = len(groups) - cfg.target_pool_groups
  ctl = PaceController(cfg)
  out = ctl.select_rejections(groups, now)
  assert len(out) == _expected_budget(cfg, excess) == ctl.last_budget
  assert len(groups) - len(out) >= min(len(groups), cfg.target_pool_groups)  # never below target
  ref = estimate_reference(groups, cfg)
  rejected = {g[0].sample_id for g, _, _ in out}
  kept = [score_group(g, now, cfg, ref).score for g in groups if g[0].sample_id not in rejected]
  for g, score, reason in out:
    assert score == pytest.approx(score_group(g, now, cfg, ref).score)
    assert reason in ("pace_waiting", "pace_generation")
    assert all(score >= s - 1e-9 for s in kept)
  # Asking again at the same version spends no more than the version's budget.
  rest = [g for g in groups if g[0].sample_id not in rejected]
  assert ctl.select_rejections(rest, now) == []


def test_pace_budget_is_per_version_and_smoothed():
  cfg = PaceConfig(target_pool_groups=2, gain=1.0, max_budget=10, smoothing=0.5)
  groups, now = _pool_groups([(5, 0, 0, w) for w in range(8)])  # excess 6
  ctl = PaceController(cfg)
  first = ctl.select_rejections(groups, now)
  assert len(first) == 3  # 0.5 * 0 + 0.5 * 6
  left = [g for g in groups if g not in [x[0] for x in first]]
  assert ctl.select_rejections(left, now) == []  # same version: budget spent
  second = ctl.select_rejections(left, now + 1)  # excess 3: 0.5 * 3 + 0.5 * 3
  assert len(second) == 3
  assert ctl.stats()["pace_rejected_total"] == 6


def test_pace_reserve_protects_the_next_batch():
  cfg = PaceConfig(target_pool_groups=1, gain=1.0, max_budget=10, smoothing=0.0)
  groups, now = _pool_groups([(5, 0, 0, w) for w in (5, 4, 3, 0)])
  out = PaceController(cfg).select_rejections(groups, now, reserve_groups=2)
  # Oldest two (most stale!) are the next batch; of the rest, 1 over target.
  assert [g[0].sample_id for g, _, _ in out] == [2]


def test_pace_reads_complete_groups_from_a_pool():
  pool = TrajectoryPool(group_size=2, max_staleness=10)
  for sid, fin in enumerate((0, 3, 3)):
    for t in make_group(sid, 2, version=0, finish_version=fin):
      pool.add(t, fin)
  pool.add(make_traj(9, 0, version=3, finish_version=3), 3)  # partial: not a candidate
  ctl = PaceController(PaceConfig(target_pool_groups=2, gain=1.0, smoothing=0.0))
  out = ctl.select_rejections(pool, 3)
  assert [g[0].sample_id for g, _, _ in out] == [0]
  assert pool.occupancy() == 3  # selection does not mutate the pool


@FAST
@given(
    long_len=st.integers(100, 2000),
    short_len=st.integers(1, 40),
    rate=st.floats(0.0005, 0.02),
    phase=st.floats(0.0, 0.999),
    v0=st.integers(0, 5),
    w_long=st.integers(0, 3),
    extra_wait=st.integers(1, 4),
    gw=st.floats(0.0, 3.0),
    ww=st.floats(0.1, 3.0),
    explicit_rate=st.booleans(),
)
def test_long_recent_rollout_not_scored_worse_than_short_one_that_waited(
    long_len, short_len, rate, phase, v0, w_long, extra_wait, gw, ww, explicit_rate
):
  """Both generated at the same speed (versions per token = ``rate``)."""
  if not explicit_rate:
    gw, ww = 0.5, 1.0  # the documented defaults; the guarantee with an estimated rate
  cfg = PaceConfig(
      target_pool_groups=0, gain=1.0, max_budget=1, smoothing=0.0,
      generation_weight=gw, waiting_weight=ww,
      versions_per_token=rate if explicit_rate else 0.0,
  )
  gen_long = int(math.floor(rate * long_len + phase))  # versions it spanned
  gen_short = int(math.floor(rate * short_len + phase))
  w_short = w_long + extra_wait
  now = v0 + gen_long + w_short + gen_short + 5
  long_g = make_group(
      0, 2, length=long_len, version=now - w_long - gen_long, finish_version=now - w_long
  )
  short_g = make_group(
      1, 2, length=short_len, version=now - w_short - gen_short, finish_version=now - w_short
  )
  ref = estimate_reference([long_g, short_g], cfg)
  assert score_group(long_g, now, cfg, ref).score <= score_group(short_g, now, cfg, ref).score
  out = PaceController(cfg).select_rejections([long_g, short_g], now)
  assert [g[0].sample_id for g, _, _ in out] == [1]  # the short, waiting one goes


def test_unexplained_generation_staleness_is_penalised():
  """A short rollout that sat 6 versions on a stalled server is not 'explained' (the
  length-only reference: request_latency_versions=0)."""
  cfg = PaceConfig(target_pool_groups=1, gain=1.0, smoothing=0.0, versions_per_token=0.01,
                   request_latency_versions=0.0)
  normal = make_group(0, 2, length=200, version=4, finish_version=6)  # explained: 2
  stalled = make_group(1, 2, length=10, version=0, finish_version=6)  # explained: 0.1
  ctl = PaceController(cfg)
  (g, score, reason), = ctl.select_rejections([normal, stalled], 6)
  assert g[0].sample_id == 1 and reason == "pace_generation"
  assert score == pytest.approx(0.5 * (6 - 0.1 - 1.0))


def test_the_fitted_reference_by_hand():
  """Versions are whole numbers: three short rollouts (1 sampled token) span 3, two
  long ones (101 tokens) 3 and one 6. Least squares over (L, g) = (1, 3) x3, (101, 3) x2,
  (101, 6): mean L 51, mean g 3.5, Sxy = 3(-50)(-0.5) + 2(50)(-0.5) + 50(2.5) = 150,
  Sxx = 6 * 2500 = 15000: k = 0.01 (a median of pairwise slopes would be 0: six of the nine
  pairs of different lengths differ by 0 versions). Residuals g - 0.01 L: 2.99 x3, 1.99 x2,
  4.99: a = median = 2.99. The 6-version long group keeps 6 - (2.99 + 1.01) - slack 1 = 1
  version unexplained, score 0.5; every other group's is 0."""
  cfg = PaceConfig(target_pool_groups=5, gain=1.0, smoothing=0.0)
  now = 20
  groups = [make_group(sid, 2, length=n, version=now - g, finish_version=now)
            for sid, (n, g) in enumerate([(1, 3), (1, 3), (1, 3), (101, 3), (101, 3), (101, 6)])]
  assert estimate_reference(groups, cfg) == GenerationReference(
      latency=pytest.approx(2.99), rate=pytest.approx(0.01))
  ctl = PaceController(cfg)
  (g, score, reason), = ctl.select_rejections(groups, now)
  assert g[0].sample_id == 5 and reason == "pace_generation"
  assert score == pytest.approx(0.5)
  stats = ctl.stats()
  assert stats["pace_reference_latency"] == pytest.approx(2.99)
  assert stats["pace_reference_versions_per_token"] == pytest.approx(0.01)
  # Configured parts are taken as given; the rest is fitted around them.
  # Residuals g - 0.02 L: 2.98 x3, 0.98 x2, 3.98: median 2.98.
  assert estimate_reference(groups, PaceConfig(versions_per_token=0.02)) == GenerationReference(
      latency=pytest.approx(2.98), rate=0.02)
  # The length-only reference: k = sum g / sum L = 21 / 306 (both members of each group).
  assert estimate_reference(groups, PaceConfig(request_latency_versions=0.0)) == \
      GenerationReference(latency=0.0, rate=pytest.approx(21 / 306))
  assert estimate_reference(groups, PaceConfig(request_latency_versions=2.0)) == \
      GenerationReference(latency=2.0, rate=pytest.approx((21 - 12) / 306))


def test_a_rollouts_latency_does_not_make_short_groups_the_stalest():
  """The long-tail benchmark's situation (README, PACE's knobs): every rollout spans ~3
  versions of latency whatever its length. Three short groups (1 token, 3 versions) and two
  long ones (40 tokens, 5 versions), one long group waiting one version in the pool; one
  group over target. Fitted: two lengths, so the least-squares line goes through both:
  slope (5 - 3) / 39, latency 3 - 2/39, nobody's generation
  staleness unexplained: the group that waited goes. Length-only (k = 38/166 per token): a
  short group keeps 3 - 38/166 - 1 = 1.77 versions unexplained, scored 1.77 with
  generation_weight 1, above the waiting long group's 1.0: PACE rejects a short group."""
  now = 10
  groups = [make_group(sid, 2, length=1, version=now - 3, finish_version=now) for sid in range(3)]
  groups.append(make_group(3, 2, length=40, version=now - 5, finish_version=now))
  groups.append(make_group(4, 2, length=40, version=now - 6, finish_version=now - 1))
  common = dict(target_pool_groups=4, gain=1.0, smoothing=0.0, generation_weight=1.0)
  fitted = PaceConfig(**common)
  assert estimate_reference(groups, fitted) == GenerationReference(
      latency=pytest.approx(3 - 2 / 39), rate=pytest.approx(2 / 39))
  (g, score, reason), = PaceController(fitted).select_rejections(groups, now)
  assert (g[0].sample_id, score, reason) == (4, pytest.approx(1.0), "pace_waiting")
  length_only = PaceConfig(**common, request_latency_versions=0.0)
  (g, score, reason), = PaceController(length_only).select_rejections(groups, now)
  assert (g[0].sample_id, reason) == (0, "pace_generation")
  assert score == pytest.approx(3 - 38 / 166 - 1)


def test_request_latency_versions_is_validated():
  with pytest.raises(Exception, match="request_latency_versions"):
    PaceConfig(request_latency_versions=-0.5)
