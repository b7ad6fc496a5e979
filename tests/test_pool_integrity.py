"""Pool assembly/eviction and the integrity ledger, including random schedules."""

from __future__ import annotations

import os
import random
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _traj import make_group, make_traj
from jax_dora.orchestrator.integrity import IntegrityLedger, read_log
from jax_dora.orchestrator.pace import PaceConfig, PaceController
from jax_dora.orchestrator.pool import DuplicateTrajectoryError, TrajectoryPool


# ----------------------------------------------------------------------- pool
def test_groups_come_out_in_order_of_completion():
  pool = TrajectoryPool(group_size=2, max_staleness=3)
  pool.add(make_traj(0, 0), 0)  # group 0 starts first ...
  pool.add(make_traj(1, 0), 0)
  assert pool.add(make_traj(1, 1), 0)  # ... but group 1 completes first
  assert pool.add(make_traj(0, 1), 1)
  assert pool.occupancy() == 2 and pool.num_trajectories() == 4
  assert [g[0].sample_id for g in pool.pop_groups(2)] == [1, 0]
  assert pool.num_trajectories() == 0


def test_duplicates_raise_and_released_keys_may_return():
  pool = TrajectoryPool(group_size=2, max_staleness=1)
  pool.add(make_traj(0, 0), 0)
  with pytest.raises(DuplicateTrajectoryError, match="already in the pool"):
    pool.add(make_traj(0, 0), 0)
  pool.add(make_traj(0, 1), 0)
  (g,) = pool.pop_groups(1)
  with pytest.raises(DuplicateTrajectoryError, match="handed to the learner"):
    pool.add(g[0], 0)
  for t in make_group(1, 2, version=0):
    pool.add(t, 0)
  assert len(pool.evict_stale(learner_version=2)) == 1
  for t in make_group(1, 2, version=2):  # regenerated after eviction: allowed
    pool.add(t, 2)
  assert pool.occupancy() == 1


def test_add_rejects_aborted_and_out_of_range_members():
  pool = TrajectoryPool(group_size=2)
  with pytest.raises(ValueError, match="aborted"):
    pool.add(make_traj(0, 0, finish_reason="aborted"), 0)
  with pytest.raises(ValueError, match="outside"):
    pool.add(make_traj(0, 2), 0)


def test_pop_batch_evicts_stale_groups_and_reports_them():
  pool = TrajectoryPool(group_size=2, max_staleness=2)
  for sid, v in ((0, 0), (1, 3), (2, 4)):
    for t in make_group(sid, 2, version=v, finish_version=v):
      pool.add(t, v)
  res = pool.pop_batch(2, learner_version=5)
  assert [g[0].sample_id for g in res.evicted] == [0]
  assert [g[0].sample_id for g in res.groups] == [1, 2]
  removals = [(r.sample_id, r.reason, r.behaviour_staleness) for r in pool.removals]
  assert removals == [(0, "stale", 5)]
  assert pool.pop_batch(1, 5).groups == []
  with pytest.raises(ValueError, match="only 0 complete"):
    pool.pop_groups(1)


def test_stale_incomplete_group_waits_until_complete():
  pool = TrajectoryPool(group_size=2, max_staleness=1)
  pool.add(make_traj(0, 0, version=0), 0)
  assert pool.evict_stale(5) == []  # its sibling is still in flight
  pool.add(make_traj(0, 1, version=0, finish_version=5), 5)
  assert [g[0].sample_id for g in pool.evict_stale(5)] == [0]


def test_remove_is_atomic_and_recorded():
  pool = TrajectoryPool(group_size=1)
  for sid in range(3):
    pool.add(make_traj(sid, 0), 0)
  groups = pool.complete_groups()
  with pytest.raises(KeyError):
    pool.remove([groups[0], make_group(7, 1)], reason="pace")
  assert pool.occupancy() == 3
  pool.remove(groups[:2], reason="pace", version=1)
  assert [(r.sample_id, r.reason) for r in pool.removals] == [(0, "pace"), (1, "pace")]
  assert pool.occupancy() == 1


# --------------------------------------------------------------------- ledger
G = 2


def _issue_finish(led, sid, version=0, spans=None, finish_version=None):
  group = make_group(sid, G, version=version, spans=spans, finish_version=finish_version)
  for t in group:
    led.issued(sid, t.member, version)
  for t in group:
    led.finished(t)
  return group


def test_clean_run_has_no_violations_in_memory_or_from_the_log(tmp_path):
  path = tmp_path / "trained_samples.jsonl"
  led = IntegrityLedger(str(path), group_size=G, max_staleness=1)
  g0 = _issue_finish(led, 0)
  g1 = _issue_finish(led, 1)
  led.issued(2, 0, 0)
  led.reissued(2, 0, "server 0 died")
  led.issued(2, 1, 0)
  led.trained(g0 + g1, learner_version=1, step=1)
  led.pending(2)
  assert led.check() == []
  led.close()
  assert IntegrityLedger.from_log(path, group_size=G, max_staleness=1).check() == []
  trained = [r for r in read_log(path) if r["event"] == "trained"]
  assert sorted((r["sample_id"], r["member"]) for r in trained) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_violations_are_reported(tmp_path):
  led = IntegrityLedger(str(tmp_path / "log.jsonl"), group_size=G, max_staleness=1)
  g0 = _issue_finish(led, 0)
  led.trained(g0, learner_version=1, step=1)
  led.trained(g0, learner_version=1, step=2)  # twice
  g1 = _issue_finish(led, 1)
  led.trained(g1[:1], learner_version=2, step=3)  # incomplete group, member 1 left open
  g2 = _issue_finish(led, 2, version=0)
  led.trained(g2, learner_version=5, step=4)  # too stale
  g3 = _issue_finish(led, 3, spans=[(0, 2, 4), (2, 4, 5)], finish_version=5)  # two versions
  led.rejected(g3, "pace", regenerate=False)
  led.trained(g3, learner_version=5, step=5)  # dropped, then trained
  led.issued(4, 0, 5)  # never accounted
  led.close()
  replay = IntegrityLedger.from_log(tmp_path / "log.jsonl", group_size=G, max_staleness=1)
  for v in (led.check(), replay.check()):
    text = "\n".join(v)
    assert "(0, 0): trained 3 times" not in text and "(0, 0): trained 2 times" in text
    assert "group 1: trained members [0]" in text
    assert "(2, 0): behaviour staleness 5 > max_staleness 1" in text
    assert "(3, 0): generated by versions [4, 5]" in text
    assert "(3, 1): trained although it was dropped" in text
    assert "(4, 0): issued but never accounted" in text
    assert "(1, 1): issued but never accounted for (last state finished)" in text
    assert "group 0: split across learner steps [1, 2]" in text


def test_a_trajectory_of_another_incarnation_is_a_violation(tmp_path):
  """Version numbers of a killed (or another) run name other parameters."""
  led = IntegrityLedger(str(tmp_path / "log.jsonl"), group_size=G, max_staleness=1,
                        incarnation="new")
  g0 = _issue_finish(led, 0)
  for t in g0:
    t.incarnation = "new"
  g1 = _issue_finish(led, 1)
  for t in g1:
    t.incarnation = "killed"
  led.trained(g0 + g1, learner_version=1, step=1)
  led.close()
  replay = IntegrityLedger.from_log(tmp_path / "log.jsonl", group_size=G, max_staleness=1)
  for v in (led.check(), replay.check()):
    assert len(v) == G and all("generated by run incarnation 'killed', trained by 'new'" in m
                               for m in v), v


def test_multi_version_allowed_when_mode_resumes(tmp_path):
  led = IntegrityLedger(None, group_size=G, max_staleness=2, allow_multi_version=True)
  g = _issue_finish(led, 0, spans=[(0, 2, 0), (2, 4, 1)], finish_version=1)
  led.trained(g, learner_version=2, step=1)
  assert led.check() == []


def test_turn_hops_may_change_versions_only_across_an_observation():
  """``orchestrator.turn_version=newest``: each turn one version, a new one only after a
  context span (the tool's observation), never inside a turn."""
  led = IntegrityLedger(None, group_size=G, max_staleness=2, allow_turn_hops=True)
  ok = make_group(0, G, spans=[(0, 2, 0), (4, 6, 1)], finish_version=1)
  bad = make_group(1, G, spans=[(0, 2, 0), (2, 4, 1), (6, 8, 1)], finish_version=1)
  for t in ok:
    t.context_spans = [(2, 4)]
  for t in bad:
    t.context_spans = [(4, 6)]
  for g in (ok, bad):
    for t in g:
      led.issued(t.sample_id, t.member, 0)
    for t in g:
      led.finished(t)
  led.trained(ok + bad, learner_version=2, step=1)
  v = led.check()
  assert len(v) == G and all("(1, " in m and "only between turns" in m for m in v), v
  # The same trajectories without the hop rule: both are violations.
  strict = IntegrityLedger(None, group_size=G, max_staleness=2)
  for g in (ok, bad):
    for t in g:
      strict.issued(t.sample_id, t.member, 0)
      strict.finished(t)
  strict.trained(ok + bad, learner_version=2, step=1)
  assert len(strict.check()) == 2 * G


def test_rejected_for_regeneration_must_come_back(tmp_path):
  led = IntegrityLedger(None, group_size=G, max_staleness=1)
  g = _issue_finish(led, 0)
  led.rejected(g, "stale", regenerate=True)
  assert led.count("stale") == 1
  assert any("awaiting_regeneration" in v for v in led.check())
  g = _issue_finish(led, 0, version=3, finish_version=3)
  led.trained(g, learner_version=3, step=1)
  assert led.check() == []


def test_resume_truncates_to_the_checkpoint_and_still_catches_retraining(tmp_path):
  path = str(tmp_path / "log.jsonl")
  led = IntegrityLedger(path, group_size=G, max_staleness=1)
  led.trained(_issue_finish(led, 0), learner_version=0, step=1)  # checkpoint at step 1
  led.trained(_issue_finish(led, 1), learner_version=1, step=2)  # lost with the kill
  led.close()
  # Resumed run: sample 1 was pending in the checkpoint and is re-issued.
  led = IntegrityLedger(path, group_size=G, max_staleness=1, truncate_after_step=1)
  led.trained(_issue_finish(led, 1, version=1, finish_version=1), learner_version=1, step=2)
  assert led.check() == []
  led.trained(_issue_finish(led, 0, version=2, finish_version=2), learner_version=2, step=3)
  assert "(0, 0): trained 2 times" in led.check()
  led.close()
  replay = IntegrityLedger.from_log(path, group_size=G, max_staleness=1)
  assert "(0, 0): trained 2 times" in replay.check()
  fresh = IntegrityLedger(path, group_size=G, max_staleness=1, truncate_after_step=0)
  assert fresh.trained_records() == []
  fresh.close()


# ---------------------------------------------------- random schedules (hyp.)
def simulate(seed: int, group_size: int, num_samples: int, max_staleness: int,
             batch_groups: int, pace: bool, on_reject: str, path: str) -> IntegrityLedger:
  """A tiny orchestrator: random arrival order, versions, evictions, PACE."""
  rng = random.Random(seed)
  pool = TrajectoryPool(group_size, max_staleness)
  ctl = PaceController(PaceConfig(target_pool_groups=1, gain=1.0, smoothing=0.0)) if pace else None
  led = IntegrityLedger(path, group_size=group_size, max_staleness=max_staleness)
  queue = list(range(num_samples))
  in_flight: list[tuple[int, int, int, int]] = []  # sid, member, start version, length
  version, step = 0, 0
  for _ in range(40 * num_samples * group_size):
    if not queue and not in_flight and pool.occupancy() == 0:
      break
    if queue and len(in_flight) < 3 * group_size and rng.random() < 0.5:
      sid = queue.pop(0)
      for m in range(group_size):
        led.issued(sid, m, version)
        in_flight.append((sid, m, version, rng.randint(1, 30)))
    elif in_flight and rng.random() < 0.7:
      sid, m, v, n = in_flight.pop(rng.randrange(len(in_flight)))
      if rng.random() < 0.1:
        led.reissued(sid, m, "server died")  # retried elsewhere, same key
        in_flight.append((sid, m, v, n))
        continue
      t = make_traj(sid, m, length=n, version=v, finish_version=version)
      led.finished(t)
      pool.add(t, version)
    else:
      for g in pool.evict_stale(version):
        led.rejected(g, "stale", regenerate=True)
        queue.append(g[0].sample_id)
      if ctl is not None:
        rej = ctl.select_rejections(pool, version)
        pool.remove([g for g, _, _ in rej], reason="pace", version=version)
        for g, _, _ in rej:
          led.rejected(g, "pace", regenerate=on_reject == "regenerate")
          if on_reject == "regenerate":
            queue.append(g[0].sample_id)
      if pool.occupancy() >= batch_groups:
        groups = pool.pop_groups(batch_groups)
        step += 1
        led.trained([t for g in groups for t in g], learner_version=version, step=step)
        with pytest.raises(DuplicateTrajectoryError):
          pool.add(groups[0][0], version)
      if rng.random() < 0.5:
        version += 1  # a publish (the learner may also train on other data)
  outstanding = (
      set(queue) | {s for s, *_ in in_flight} | {g[0].sample_id for g in pool.complete_groups()}
  )
  for sid in sorted(outstanding):
    led.pending(sid)
  led.close()
  return led


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    group_size=st.integers(1, 4),
    num_samples=st.integers(1, 10),
    max_staleness=st.integers(0, 3),
    batch_groups=st.integers(1, 3),
    pace=st.booleans(),
    on_reject=st.sampled_from(["regenerate", "drop"]),
)
def test_random_schedules_never_violate_integrity(
    seed, group_size, num_samples, max_staleness, batch_groups, pace, on_reject
):
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "trained_samples.jsonl")
    led = simulate(
        seed, group_size, num_samples, max_staleness, batch_groups, pace, on_reject, path
    )
    assert led.check() == []
    replay = IntegrityLedger.from_log(path, group_size=group_size, max_staleness=max_staleness)
    assert replay.check() == []
    # Every sample is accounted for: trained, dropped, or carried as pending.
    recs = read_log(path)
    trained = {r["sample_id"] for r in recs if r["event"] == "trained"}
    dropped = {r["sample_id"] for r in recs if r["event"] == "rejected" and not r["regenerate"]}
    pending = {r["sample_id"] for r in recs if r["event"] == "pending"}
    assert trained | dropped | pending == set(range(num_samples))
    assert not trained & dropped
