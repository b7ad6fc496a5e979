"""Time to synchronous RL's reward, and reward at equal wall clock, over seeds.

The learning claims of the papers, measured on this system: PACE reports
matching synchronous RL's accuracy with 47.1% less GPU time and +18.7% over
unfiltered asynchronous RL at the same wall clock; DORA reports 2-3x
throughput without compromising convergence. For every seed:

1. ``sync`` trains for a wall-clock budget ``B``; its final held-out reward
   is that seed's **target**: the median of its last ``--target_points`` (3)
   scheduled evaluations, the level of its plateau (the held-out reward of a
   plateaued policy moves from version to version, now and then far above
   its neighbours, and a target set on such a point would be out of every
   mode's reach; ``reward_curves.final_reward``).
2. Each other mode (default ``async_unfiltered``, ``dora``, ``dora_pace``)
   trains for ``2B`` from the same initial policy and data order (same seed).
3. Every run keeps all its policy snapshots (``snapshots.max_to_keep=0``).
   After the run, the versions that were the newest *published* at each point
   of a fixed wall-clock schedule (``0, every_s, 2 every_s, ...``; the run's
   training clock, which starts after compilation) are evaluated on the same
   held-out prompts with the same sample count for every mode, by
   ``python -m jax_dora.evaluate --steps`` on its own servers. **Evaluation
   therefore never runs inside any mode's clock**: no mode pays for it, and
   none is slowed by it. (The in-training eval shares the rollout servers and
   would tax the faster-stepping modes more often.)

Reported per mode, over seeds (mean ± standard error; seeds pair with the
``sync`` run of the same seed): wall time and device-seconds (cores held x
wall time: in ``split`` placement every mode holds the same two cores, so the
device-seconds ratio equals the wall-time ratio) to first reach the target,
how many seeds reached it within ``2B``, the reward at ``B``, the mean reward
over ``[0, B]`` (area under the curve / B) and the paired ratio of
device-seconds to the target against ``sync``'s own.

Runs use ``benchmarks/modes.py``'s placement (default ``split``: learner and a
gRPC rollout server on disjoint cores) and workloads. The order of the modes
is shuffled per seed so the machine's speed drift does not favour one mode.

Usage::

  python benchmarks/time_to_reward.py                      # the default: about an hour on 2 cores
  python benchmarks/time_to_reward.py --budget_s 60 --seeds 2 --modes dora_pace
  python -m jax_dora.report --curves OUT/time_to_reward.json -o reward_curves.png
  # a knob of one mode against its default, in the same seeds (issue 27's part 4):
  python benchmarks/time_to_reward.py --modes dora_pace,dora_pace@big_pool \
      --variant big_pool:--config.pace.target_pool_groups=16
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import modes as modes_bench  # pylint: disable=g-import-not-at-top,wrong-import-position

from jax_dora.metrics import reward_curves as rc  # pylint: disable=g-import-not-at-top,wrong-import-position

DEFAULT_MODES = ("async_unfiltered", "dora", "dora_pace")


def evaluate_curve(run_dir: pathlib.Path, until_s: float, every_s: float, num_prompts: int,
                   num_samples: int) -> list[dict]:
  """The run's held-out reward at each scheduled wall-clock point.

  Reads which version was the newest published at each point from the run's
  ``metrics.jsonl`` and evaluates each distinct version once, in one
  ``jax_dora.evaluate`` process (its own servers, after the run).
  """
  recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
  timeline = rc.published_timeline(recs)
  points = [(t, rc.version_at(timeline, t)) for t in rc.schedule(until_s, every_s)]
  versions = sorted({v for _, v in points})
  proc = subprocess.run(
      [sys.executable, "-m", "jax_dora.evaluate", f"--run_dir={run_dir}",
       f"--steps={','.join(map(str, versions))}", f"--num_prompts={num_prompts}",
       f"--num_samples={num_samples}"],
      cwd=ROOT, env=modes_bench._env(), capture_output=True, text=True)  # pylint: disable=protected-access
  (run_dir / "evaluate.log").write_text(proc.stdout + proc.stderr)
  if proc.returncode != 0:
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f"evaluating {run_dir} failed with exit code {proc.returncode}")
  by_version = {o["step"]: o for o in json.loads((run_dir / "eval_steps.json").read_text())}
  curve = [{"t": t, "version": v, "reward": by_version[v]["eval/reward"],
            "stderr": by_version[v].get("eval/reward_stderr")} for t, v in points]
  (run_dir / "eval_curve.json").write_text(json.dumps(curve, indent=1))
  return curve


def run_one(mode: str, seed: int, out: pathlib.Path, budget_s: float, every_s: float,
            a: argparse.Namespace, overrides: list[str]) -> dict:
  extra = overrides + [
      f"--config.seed={seed}",
      "--config.snapshots.max_to_keep=0",  # every version stays on disk for the evaluation
      "--config.eval.num_prompts=0",  # no evaluation inside the clock (see the docstring)
      "--config.eval.at_start=False",
  ]
  t0 = time.time()
  summary = modes_bench.run_mode(mode.partition("@")[0], out, budget_s, extra, a.placement)
  trained_s = time.time() - t0
  # A step may end a little past the budget; the curve stops at the budget.
  curve = evaluate_curve(out, budget_s, every_s, a.eval_prompts, a.eval_samples)
  if not a.keep_snapshots:
    shutil.rmtree(out / "snapshots", ignore_errors=True)
  print(f"  {mode:<17} seed {seed}: {summary['steps']:>4} steps,"
        f" {summary['trained_tokens_per_s']:>6.0f} tok/s, reward"
        f" {curve[0]['reward']:.3f} -> {curve[-1]['reward']:.3f}"
        f" (run {trained_s:.0f}s + eval {time.time() - t0 - trained_s:.0f}s)", flush=True)
  return {"mode": mode, "seed": seed, "run_dir": str(out), "curve": curve,
          "steps": summary["steps"], "trained_tokens_per_s": summary["trained_tokens_per_s"],
          "bubble_ratio": summary["bubble_ratio"], "wasted_share": summary["wasted_share"],
          "integrity_violations": len(summary.get("integrity_violations") or [])}


def _fmt(ms: tuple[float, float], spec: str = ".3f") -> str:
  m, se = ms
  if m != m:
    return "n/a"
  return f"{m:{spec}}" + (f" ± {se:{spec}}" if se == se else "")


def print_table(summary: dict, budget_s: float) -> None:
  print(f"\n{'mode':<18}{'reached':>8}{'time to target s':>20}{'dev-s x sync':>16}"
        f"{'reward at B':>18}{'mean R over [0,B]':>20}")
  for mode, row in summary.items():
    print(f"{mode:<18}{row['reached']:>4}/{row['seeds']:<3}{_fmt(row['time_to_target_s'], '.0f'):>20}"
          f"{_fmt(row['x_ref_device_s'], '.2f'):>16}{_fmt(row['reward_at_budget']):>18}"
          f"{_fmt(row['mean_reward_to_budget']):>20}")
  targets = next(iter(summary.values()))["targets"]
  print(f"\ntargets (sync's final held-out reward at B = {budget_s:.0f}s, per seed):"
        f" {', '.join(f'{t:.3f}' for t in targets)}")


def _summarize(runs: list[dict], modes: list[str], budget: float, devices: float,
               target_points: int) -> dict:
  curves: dict[str, list] = {m: [] for m in modes}
  for r in sorted(runs, key=lambda r: r["seed"]):
    curves[r["mode"]].append([(p["t"], p["reward"]) for p in r["curve"]])
  return rc.summarize(curves, budget, devices={m: devices for m in curves},
                      target_points=min(target_points, len(curves["sync"][0])))


def resummarize(path: pathlib.Path, target_points: int) -> dict:
  """The table again from a finished run's stored curves."""
  result = json.loads(path.read_text())
  modes = list(dict.fromkeys(["sync", *(r["mode"] for r in result["runs"])]))
  result["summary"] = _summarize(result["runs"], modes, result["budget_s"],
                                 result["devices_per_run"], target_points)
  result["target_points"] = target_points
  print(f"{path}: {result['workload']}, B={result['budget_s']:.0f}s, {result['seeds']} seed(s),"
        f" run {result['date']}; target = median of sync's last {target_points} point(s)")
  print_table(result["summary"], result["budget_s"])
  path.write_text(json.dumps(result, indent=1))  # the runs unchanged, the summary recomputed
  return result


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--budget_s", type=float, default=120.0, help="B: sync's wall-clock budget")
  ap.add_argument("--target_points", type=int, default=3,
                  help="sync's last scheduled evaluations whose median is the target")
  ap.add_argument("--every_s", type=float, default=0.0,
                  help="evaluation schedule step (default B / 6)")
  ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help="modes compared with sync")
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--workload", choices=sorted(modes_bench.WORKLOADS), default="long_tail")
  ap.add_argument("--placement", choices=("split", "shared"), default="split")
  ap.add_argument("--eval_prompts", type=int, default=512)
  ap.add_argument("--eval_samples", type=int, default=1)
  ap.add_argument("--out", default="", help="directory for the runs (default: temp)")
  ap.add_argument("--keep_snapshots", action="store_true",
                  help="keep every run's snapshots (default: deleted once evaluated)")
  ap.add_argument("--variant", action="append", default=[], metavar="NAME:--config.x=y,...",
                  help="names a set of overrides; a mode written MODE@NAME in --modes runs with"
                       " them (repeatable)")
  ap.add_argument("--from_json", default="", metavar="JSON",
                  help="recompute the table from a finished run's time_to_reward.json (its stored"
                       " curves; e.g. with another --target_points) instead of running")
  a, overrides = ap.parse_known_args(argv)
  bad = [o for o in overrides if not o.startswith("--config.")]
  if bad:
    ap.error(f"unrecognized arguments {bad} (config overrides look like --config.x=y)")
  if a.from_json:
    return resummarize(pathlib.Path(a.from_json), a.target_points)
  modes_bench.CONFIG = modes_bench.WORKLOADS[a.workload]
  budget = a.budget_s
  every = a.every_s or budget / 6
  others = [m for m in a.modes.split(",") if m and m != "sync"]
  try:
    variants = modes_bench.parse_variants(a.variant)
  except ValueError as e:
    ap.error(str(e))
  unknown = [m for m in others if "@" in m and m.partition("@")[2] not in variants]
  if unknown:
    ap.error(f"modes {unknown} name no --variant")
  base = pathlib.Path(a.out or tempfile.mkdtemp(prefix="jax_dora_ttr_"))
  base.mkdir(parents=True, exist_ok=True)
  if a.placement == "split":
    learner_cores, rollout_cores = modes_bench.split_cores()
    devices = float(len(learner_cores) + len(rollout_cores))
  else:
    devices = float(len(os.sched_getaffinity(0)))
  print(f"workload {modes_bench.CONFIG} {' '.join(overrides)}; sync for B={budget:.0f}s, "
        f"{', '.join(others)} for 2B; held-out reward every {every:.0f}s of each run's clock"
        f" ({a.eval_prompts} prompts x {a.eval_samples}), evaluated after each run;"
        f" {a.seeds} seed(s); placement {a.placement}", flush=True)
  runs: list[dict] = []
  for seed in range(a.seeds):
    order = ["sync", *others]
    random.Random(seed).shuffle(order)
    print(f"seed {seed}: {', '.join(order)}", flush=True)
    for mode in order:
      b = budget if mode == "sync" else 2 * budget
      runs.append(run_one(mode, seed, base / f"seed{seed}" / mode, b, every, a,
                          overrides + variants.get(mode.partition("@")[2], [])))
  summary = _summarize(runs, ["sync", *others], budget, devices, a.target_points)
  print_table(summary, budget)
  result = {"workload": modes_bench.CONFIG, "overrides": overrides, "budget_s": budget,
            "every_s": every, "target_points": a.target_points, "seeds": a.seeds, "placement": a.placement,
            "devices_per_run": devices, "eval_prompts": a.eval_prompts, "variants": variants,
            "eval_samples": a.eval_samples, "date": time.strftime("%Y-%m-%d %H:%M"),
            "summary": summary, "runs": runs}
  path = base / "time_to_reward.json"
  path.write_text(json.dumps(result, indent=1))
  print(f"\n{path}\nfigure: python -m jax_dora.report --curves {path} -o reward_curves.png")
  return result


if __name__ == "__main__":
  main()
