"""The modes benchmark runs end to end (no performance assertions here: the
ratios it prints are the claim, measured side by side in one run)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="split placement needs 2 cores")
def test_modes_benchmark_split_placement_smoke(tmp_path):
  """Learner and a gRPC rollout server on disjoint cores; table printed, data intact."""
  proc = subprocess.run(
      [sys.executable, "benchmarks/modes.py", "--modes=sync,dora_pace", "--budget_s=6",
       f"--out={tmp_path}", "--config.eval.num_prompts=8", "--config.precompile=False"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  rows = {m.group(1): m.group(0) for m in re.finditer(r"^(sync|dora_pace)\s+\d+\s.*$", proc.stdout, re.M)}
  assert set(rows) == {"sync", "dora_pace"}, proc.stdout
  for row in rows.values():
    assert row.split()[-1] == "0", f"integrity violations: {row}"  # last column
  assert "placement split" in proc.stdout
  summary = json.loads((tmp_path / "dora_pace" / "summary.json").read_text())
  assert summary["final_eval_reward_stderr"] >= 0.0  # the eval's noise is reported with it
  # The learner really talked to a separate server process over gRPC.
  log = (tmp_path / "dora_pace" / "rollout_server.log").read_text()
  assert "serving on" in log


def test_modes_benchmark_rejects_unknown_flags():
  proc = subprocess.run([sys.executable, "benchmarks/modes.py", "--bogus=1"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode != 0 and "config overrides look like --config.x=y" in proc.stderr


def test_learner_memory_benchmark_chunked_below_naive():
  """Small sizes (the full benchmark is V=151,936, T=2,048): the chunked step's
  temporaries are below the naive step's and close to the two-term prediction."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import learner_memory  # pylint: disable=g-import-not-at-top

  res = learner_memory.main(["--vocab=20000", "--seq_len=513", "--rows=2", "--chunk=64",
                             "--d_model=64"])
  names = [n for n in res if n != "model"]
  naive, chunked, micro = (res[n]["temp"] for n in names[:3])
  assert chunked < naive / 2 and micro <= chunked
  predicted = res["model"]["predicted_chunked_temp"]
  assert abs(chunked - predicted) / predicted < 0.35, res


def test_staleness_sweep_reads_realised_staleness_and_mismatch(tmp_path):
  """The sweep's per-run numbers from a metrics log written out by hand (the
  full sweep is an hour; its runs are benchmarks/modes.py runs, smoke-tested above)."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import staleness_sweep  # pylint: disable=g-import-not-at-top

  recs = [
      {"staleness_behaviour": {"mean": 0.0, "max": 0, "n": 4}, "train/stale_token_frac": 0.0,
       "train/mismatch/kl_k3_stale0": 0.0, "train/mismatch/kl_k3_stale_gt0": 0.0,
       "train/is_weight_max": 1.0},
      {"staleness_behaviour": {"mean": 3.0, "max": 5, "n": 4}, "train/stale_token_frac": 0.5,
       "train/mismatch/kl_k3_stale0": 0.0, "train/mismatch/kl_k3_stale_gt0": 0.02,
       "train/is_weight_max": 2.5},
  ]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
  m = staleness_sweep.run_metrics(tmp_path)
  # Mean of step means; KL of stale tokens only over steps that had any.
  assert m == {"staleness_mean": 1.5, "staleness_max": 5, "kl_stale0": 0.0,
               "kl_stale_gt0": 0.02, "is_weight_max": 2.5}
  with pytest.raises(SystemExit):
    staleness_sweep.main(["--losses=ppo2"])
