"""The time-to-reward benchmark: its arithmetic against hand-computed numbers,
and one tiny end-to-end run (real split placement, real snapshots, real
offline evaluation)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jax_dora.metrics import reward_curves as rc

ROOT = pathlib.Path(__file__).resolve().parents[1]

SYNC_SEED0 = [(0, 0.10), (10, 0.20), (20, 0.25), (30, 0.30)]
FAST_SEED0 = [(0, 0.10), (10, 0.22), (20, 0.31), (30, 0.35), (40, 0.36), (50, 0.36), (60, 0.37)]
SYNC_SEED1 = [(0, 0.10), (10, 0.30), (20, 0.30), (30, 0.20)]
FAST_SEED1 = [(0, 0.10), (10, 0.15), (20, 0.25), (30, 0.26), (40, 0.27), (50, 0.27), (60, 0.28)]
NEVER = [(0, 0.10), (10, 0.12), (20, 0.14), (30, 0.16), (40, 0.18), (50, 0.19), (60, 0.19)]


def test_time_to_target_reward_at_and_area_by_hand():
  assert rc.time_to_target(FAST_SEED0, 0.30) == 20
  assert rc.time_to_target(NEVER, 0.30) is None
  assert rc.time_to_target(SYNC_SEED0, 0.30) == 30  # equal counts as reached
  assert rc.reward_at(FAST_SEED0, 30) == 0.35
  assert rc.reward_at(FAST_SEED0, 35) == 0.35  # the last point at or before t
  # Trapezoids: 10*(.10+.22)/2 + 10*(.22+.31)/2 + 10*(.31+.35)/2 = 7.55, over 30 s.
  assert rc.mean_reward_over(FAST_SEED0, 30) == pytest.approx(7.55 / 30)
  assert rc.mean_reward_over(SYNC_SEED0, 30) == pytest.approx(6.5 / 30)
  # Past the last point the last value is held: 7.55 + 5 * 0.35 over 35 s.
  assert rc.mean_reward_over(FAST_SEED0[:4], 35) == pytest.approx((7.55 + 1.75) / 35)


def test_target_is_the_mean_of_the_last_points():
  assert rc.final_reward(SYNC_SEED0, 30) == 0.30
  assert rc.final_reward(SYNC_SEED0, 30, points=3) == 0.25  # median of .20, .25, .30
  assert rc.final_reward(SYNC_SEED0, 25, points=2) == pytest.approx((0.20 + 0.25) / 2)
  spike = [(0, 0.25), (20, 0.29), (40, 0.385), (60, 0.315), (80, 0.314)]
  assert rc.final_reward(spike, 80, points=3) == 0.315  # one outlying version does not set it
  with pytest.raises(ValueError, match="need 5"):
    rc.final_reward(SYNC_SEED0, 30, points=5)
  out = rc.summarize({"sync": [SYNC_SEED0], "fast": [FAST_SEED0]}, budget_s=30, target_points=3)
  assert out["fast"]["targets"] == [pytest.approx(0.25)] and out["fast"]["times"] == [20]
  assert out["sync"]["times"] == [20]  # sync's own first point >= 0.25


def test_summarize_pairs_seeds_with_sync_by_hand():
  out = rc.summarize({"sync": [SYNC_SEED0, SYNC_SEED1], "fast": [FAST_SEED0, FAST_SEED1],
                      "never": [NEVER, NEVER]}, budget_s=30,
                     devices={"sync": 2, "fast": 2, "never": 2})
  # Targets: sync's reward at B per seed (0.30, then 0.20: seed 1 fell back).
  assert out["fast"]["targets"] == [0.30, 0.20]
  # Seed 0: fast reaches 0.30 at 20 s; seed 1: 0.20 at 20 s.
  assert out["fast"]["times"] == [20, 20] and out["fast"]["reached"] == 2
  assert out["fast"]["time_to_target_s"] == (20, 0)
  assert out["fast"]["device_s_to_target"][0] == 40  # 2 devices x 20 s
  # Sync itself reached 0.30 at 30 s and 0.20 at 10 s: ratios 20/30 and 20/10.
  assert out["sync"]["times"] == [30, 10]
  mean, se = out["fast"]["x_ref_device_s"]
  assert mean == pytest.approx((2 / 3 + 2) / 2)
  assert se == pytest.approx(abs(2 - 2 / 3) / 2)  # stdev of two values / sqrt(2)
  assert out["fast"]["reward_at_budget"][0] == pytest.approx((0.35 + 0.26) / 2)
  assert out["never"]["reached"] == 0 and out["never"]["time_to_target_s"][0] != out[
      "never"]["time_to_target_s"][0]  # NaN: no seed reached it
  with pytest.raises(ValueError, match="reference"):
    rc.summarize({"fast": [FAST_SEED0]}, budget_s=30)


def test_version_at_reads_published_versions_from_records():
  recs = [{"wall_time_s": 1.5, "published_version": 1}, {"wall_time_s": 2.0, "published_version": 1},
          {"wall_time_s": 3.1, "published_version": 3}, {"step": 9}]
  tl = rc.published_timeline(recs)
  assert tl == [(0.0, 0), (1.5, 1), (3.1, 3)]
  assert [rc.version_at(tl, t) for t in (0, 1.4, 1.5, 3.0, 3.1, 99)] == [0, 0, 1, 1, 3, 3]
  assert rc.schedule(30, 10) == [0, 10, 20, 30]
  assert rc.schedule(25, 10) == [0, 10, 20]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="split placement needs 2 cores")
def test_time_to_reward_tiny_budget_end_to_end(tmp_path):
  """sync and dora_pace for a few seconds each, evaluated offline from kept
  snapshots; the table, the JSON and the figure come out consistent.

  Slow (2-3 minutes on the 2-core CI machine: four processes start and
  compile): the schedule, the targets and the version lookup it relies on
  are checked by hand in the default suite above."""
  proc = subprocess.run(
      [sys.executable, "benchmarks/time_to_reward.py", "--budget_s=6", "--every_s=3",
       "--seeds=1", "--modes=dora_pace", "--eval_prompts=8", f"--out={tmp_path}",
       # A shorter tail: fewer programs to compile before the clock.
       "--config.data.max_answer_len=47", "--config.rollout.max_new_tokens=48",
       "--config.model.max_seq_len=96", "--config.learner.seq_len_buckets=64"],
      cwd=ROOT, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  result = json.loads((tmp_path / "time_to_reward.json").read_text())
  by_mode = {r["mode"]: r for r in result["runs"]}
  assert set(by_mode) == {"sync", "dora_pace"}
  assert [p["t"] for p in by_mode["sync"]["curve"]] == [0, 3, 6]
  assert [p["t"] for p in by_mode["dora_pace"]["curve"]] == [0, 3, 6, 9, 12]
  for r in result["runs"]:
    assert r["integrity_violations"] == 0
    versions = [p["version"] for p in r["curve"]]
    # Compilation happens before the clock (config.precompile), so versions
    # are published inside even a 6 s budget.
    assert versions[0] == 0 and versions == sorted(versions) and versions[-1] > 0
    assert not (pathlib.Path(r["run_dir"]) / "snapshots").exists()  # deleted once evaluated
  # Version 0 is the same initial policy for both modes (same seed, same prompts).
  assert by_mode["sync"]["curve"][0]["reward"] == pytest.approx(
      by_mode["dora_pace"]["curve"][0]["reward"], abs=0.05)
  target = result["summary"]["sync"]["targets"][0]
  # The median of sync's last three scheduled points (here all of them).
  assert target == sorted(p["reward"] for p in by_mode["sync"]["curve"])[1]
  assert rc.time_to_target([(p["t"], p["reward"]) for p in by_mode["dora_pace"]["curve"]],
                           target) == result["summary"]["dora_pace"]["times"][0]
  assert "time to target" in proc.stdout and "targets (sync's final held-out reward" in proc.stdout
  png = tmp_path / "curves.png"
  rep = subprocess.run([sys.executable, "-m", "jax_dora.report", "--curves",
                        str(tmp_path / "time_to_reward.json"), "-o", str(png)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert rep.returncode == 0, rep.stderr
  assert png.stat().st_size > 10_000
