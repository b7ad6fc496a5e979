"""Every training mode on the same long-tailed workload, side by side.

Each mode runs as its own process (fresh JAX runtime, same seed, same config,
same wall-clock budget) with the learner and the embedded rollout servers on
disjoint forced host devices. The table reports, measured in this one run:

* trained tokens/s (completion tokens the learner consumed per second) and its
  ratio to ``sync``;
* learner bubble ratio (share of step time the learner waited for data);
* held-out reward at the end of the budget;
* integrity violations found in the trained-sample log (must be 0).

Usage: python benchmarks/modes.py [--budget_s 150] [--modes sync,dora,...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL_MODES = ("sync", "one_step_off", "partial_rollout", "async_unfiltered", "dora", "dora_pace")


def run_mode(mode: str, out: pathlib.Path, budget_s: float, extra: list[str]) -> dict:
  args = [
      sys.executable, "-m", "jax_dora.train", "--config=configs/tiny.py",
      f"--config.mode={mode}",
      f"--config.output_dir={out}",
      f"--config.max_wall_time_s={budget_s}",
      "--config.total_steps=100000",
      "--config.progress_bar=False",
      "--config.checkpoint.resume=False",
      *extra,
  ]
  env = dict(os.environ)
  env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  t0 = time.time()
  proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
  if proc.returncode not in (0, 3):
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f"mode {mode} failed with exit code {proc.returncode}")
  summary = json.loads((out / "summary.json").read_text())
  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
  wait = sum(r["learner_wait_s"] for r in recs[1:])  # step 1 includes compilation
  busy = sum(r["learner_train_s"] + r["publish_s"] for r in recs[1:])
  summary["bubble_ratio"] = wait / max(wait + busy, 1e-9)
  summary["process_s"] = time.time() - t0
  summary["mean_reward_last"] = (
      sum(r["reward_mean"] for r in recs[-5:]) / max(len(recs[-5:]), 1) if recs else float("nan")
  )
  return summary


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--budget_s", type=float, default=150.0, help="training wall-clock budget per mode")
  ap.add_argument("--modes", default=",".join(ALL_MODES))
  ap.add_argument("--quick", action="store_true", help="short budget smoke run")
  ap.add_argument("--out", default="", help="directory for per-mode runs (default: temp)")
  ap.add_argument("overrides", nargs="*", help="extra --config.x=y overrides for every mode")
  a = ap.parse_args()
  budget = 40.0 if a.quick else a.budget_s
  base = pathlib.Path(a.out or tempfile.mkdtemp(prefix="jax_dora_modes_"))
  modes = [m for m in a.modes.split(",") if m]
  results = {}
  for m in modes:
    print(f"running {m} for {budget:.0f}s ...", flush=True)
    results[m] = run_mode(m, base / m, budget, a.overrides)
  ref = results.get("sync", {}).get("trained_tokens_per_s")
  print()
  print(f"{'mode':<18}{'steps':>6}{'tok/s':>10}{'x sync':>8}{'bubble':>8}{'eval R':>8}{'train R':>8}{'violations':>11}")
  for m, s in results.items():
    ratio = s["trained_tokens_per_s"] / ref if ref else float("nan")
    ev = s.get("final_eval_reward")
    print(
        f"{m:<18}{s['steps']:>6}{s['trained_tokens_per_s']:>10.1f}{ratio:>8.2f}"
        f"{s['bubble_ratio']:>8.2%}{(ev if ev is not None else float('nan')):>8.3f}"
        f"{s['mean_reward_last']:>8.3f}{len(s['integrity_violations']):>11}"
    )
  print(f"\nruns in {base}; plot with: python scripts/plot_metrics.py {base}/*/metrics.jsonl -o modes.png")


if __name__ == "__main__":
  main()
