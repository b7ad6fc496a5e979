"""JSONL metrics, staleness histograms, and the plotting script."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jax_dora.metrics.histogram import histogram_counts, staleness_histogram
from jax_dora.metrics.jsonl import MetricsWriter, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_writer_adds_step_and_time_and_converts_numpy(tmp_path):
  path = tmp_path / "run" / "metrics.jsonl"
  with MetricsWriter(str(path)) as w:
    w.write({
        "step": np.int64(3), "loss": np.float32(0.5), "vec": np.arange(3),
        "ok": np.bool_(True), "bad": float("nan"), "hist": {"0": np.int32(2)},
        "big": np.float32("inf"),
    })
    # Flushed per line: readable while the writer is still open.
    (rec,) = read_metrics(path)
    w.write({"x": 1})
  assert rec["step"] == 3 and rec["loss"] == 0.5 and rec["vec"] == [0, 1, 2] and rec["ok"] is True
  # Non-finite values stay visible (never silently null) and valid JSON.
  assert rec["bad"] == "NaN" and rec["big"] == "Infinity"
  assert rec["hist"] == {"0": 2} and rec["time"] > 0
  recs = read_metrics(path)
  assert recs[1]["step"] == 1 and recs[1]["x"] == 1
  with MetricsWriter(str(path)) as w:  # a resumed run appends
    w.write({"x": 2}, step=9)
  assert [r["step"] for r in read_metrics(path)] == [3, 1, 9]


def test_read_metrics_skips_a_torn_last_line_only(tmp_path):
  path = tmp_path / "m.jsonl"
  path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
  assert [r["step"] for r in read_metrics(path)] == [1, 2]
  path.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
  with pytest.raises(ValueError, match=":2:"):
    read_metrics(path)


def test_staleness_histogram():
  h = staleness_histogram([0, 0, 1, 3, 3, 3])
  assert histogram_counts(h) == {0: 2, 1: 1, 3: 3}
  assert h["0"] == 2 and h["mean"] == pytest.approx(10 / 6) and h["max"] == 3 and h["n"] == 6
  json.dumps(h)
  frac = staleness_histogram([0.4, 2.5])  # token-weighted values round to buckets
  assert histogram_counts(frac) == {0: 1, 3: 1} and frac["max"] == 2.5
  empty = staleness_histogram([])
  assert empty == {"mean": None, "max": None, "n": 0}


def test_plot_script_writes_a_png(tmp_path):
  runs = []
  for mode, speed in (("dora_pace", 3.0), ("sync", 1.0)):
    path = tmp_path / mode / "metrics.jsonl"
    with MetricsWriter(str(path)) as w:
      for s in range(1, 6):
        w.write({
            "step": s, "mode": mode, "wall_time_s": s / speed, "reward_mean": 0.1 * s,
            "trained_tokens_per_s": 100 * speed, "bubble_ratio": 0.5 / speed,
            "staleness_effective": staleness_histogram([0, s % 3]), "eval_reward": None,
            "train/mismatch/kl_k3_stale_gt0": 1e-3 * s,
        })
    runs.append(str(path))
  out = tmp_path / "plots" / "compare.png"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "plot_metrics.py"),
       f"pace={runs[0]}", runs[1], "-o", str(out)],
      capture_output=True, text=True, timeout=120, cwd=tmp_path,
  )
  assert proc.returncode == 0, proc.stderr
  data = out.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
  # Any metric key as a panel (here the loss's mismatch metric).
  one = tmp_path / "plots" / "mismatch.png"
  proc = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "plot_metrics.py"), runs[0], "-o", str(one),
       "--panels", "train/mismatch/kl_k3_stale_gt0"],
      capture_output=True, text=True, timeout=120, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert one.read_bytes()[:4] == b"\x89PNG"


def test_log_line_reports_the_mismatch_kl():
  from jax_dora.orchestrator.telemetry import log_line  # pylint: disable=g-import-not-at-top

  rec = {"step": 3, "reward_mean": 0.25, "completion_len_mean": 12.0, "train/loss": 0.5,
         "bubble_ratio": 0.1, "trained_tokens_per_s": 100.0, "pool_groups": 2,
         "staleness_behaviour": {"mean": 1.5, "max": 3}, "train/mismatch/kl_k3": 0.0123}
  assert log_line(rec) == ("step 3 | reward 0.250 | len 12 | loss 0.5000 | bubble 0.10 | 100 tok/s"
                           " | staleness mean 1.50 max 3 | pool 2 | mismatch kl 1.2e-02")


def test_dashboard_tags_flatten_a_record():
  """What TensorBoard / W&B receive from one metrics record (jax_dora.metrics.writers)."""
  import math  # pylint: disable=g-import-not-at-top

  from jax_dora.metrics.writers import flatten_scalars, histograms  # pylint: disable=g-import-not-at-top

  rec = {"step": 3, "time": 1.0, "mode": "dora", "reward_mean": 0.5, "ok": True, "bad": "NaN",
         "pace": {"pace_budget": 2, "pace_reason/x": 1}, "vec": [1, 2], "none": None,
         "staleness_waiting": {"0": 2, "2": 1, "mean": 2 / 3, "max": 2, "n": 3},
         "staleness_generation": {"mean": None, "max": None, "n": 0}}
  tags = flatten_scalars(rec)
  assert math.isnan(tags.pop("bad"))
  assert tags == {"reward_mean": 0.5, "ok": 1.0, "pace/pace_budget": 2.0,
                  "pace/pace_reason/x": 1.0, "staleness_waiting/mean": 2 / 3,
                  "staleness_waiting/max": 2.0}
  assert histograms(rec) == {"staleness_waiting": {0: 2, 2: 1}}
