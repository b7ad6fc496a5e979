"""A short chaos run (``benchmarks/chaos.py``): no sample lost or duplicated, no
staleness violation, while rollout servers are SIGKILLed and restarted, one is
SIGSTOPped past the health threshold, and the learner is SIGKILLed and resumed.

The benchmark's default run (minutes, servers stopped past the old 120 s
request deadline) is the full version; this one shrinks the intervals and the
health thresholds so the same events happen in well under a minute, three
learner steps apart.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_short_chaos_run_loses_and_duplicates_nothing(tmp_path):
  proc = subprocess.run(
      # Events every 3 learner steps (and >= 1 s apart): the schedule lands
      # inside the run however fast the learner is (with warm compilation
      # caches 24 steps took 14 s here, too fast for a 5 s clock).
      # 40 steps: at 30 a warm learner once finished before the last stop could
      # be delivered (both servers busy being killed / stopped / restarted). Every
      # trained trajectory's version labels and reward are re-derived as well.
      [sys.executable, "benchmarks/chaos.py", "--steps", "40", "--interval", "1",
       "--interval-steps", "3", "--stop-seconds", "3", "--restart-after", "2",
       "--schedule", "kill,stop,learner,stop",
       f"--out={tmp_path}", "--timeout", "500",
       "--learner-arg=--config.rollout.health_interval_s=0.5",
       "--learner-arg=--config.rollout.unhealthy_after_s=2",
       "--learner-arg=--config.audit.verify_fraction=1.0",
       "--learner-arg=--config.audit.label_time_share=1.0"],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=560)
  out = proc.stdout + proc.stderr[-3000:]
  assert proc.returncode == 0, out
  assert re.search(r"chaos: \{.*'kill': 1.*\}", out) and "'learner': 1" in out and "'stop': 2" in out, out
  for key in ("lost", "duplicated", "staleness_violations", "audit_violations"):
    assert re.search(rf"^  {key}\s+0$", out, re.M), out
  assert re.search(r"^  steps\s+40$", out, re.M), out
  # The learner's two incarnations both trained: the resumed one on the live servers.
  logs = sorted((tmp_path / "logs").glob("learner.*.log"))
  assert len(logs) == 2 and "resumed from step" in logs[1].read_text(), [l.name for l in logs]
