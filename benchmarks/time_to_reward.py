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
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import modes as modes_bench  # pylint: disable=g-import-not-at-top,wrong-import-position
from _procs import evaluate_versions  # pylint: disable=g-import-not-at-top,wrong-import-position

from jax_dora.metrics import reward_curves as rc  # pylint: disable=g-import-not-at-top,wrong-import-position

DEFAULT_MODES = ("async_unfiltered", "dora", "dora_pace")


def rows_per_step(run_dir: pathlib.Path) -> int:
  """Samples one learner step trains (one step = one published version), from the run's config."""
  learner = json.loads((run_dir / "config.json").read_text())["learner"]
  return int(learner["groups_per_step"]) * int(learner["group_size"])


def evaluate_curve(run_dir: pathlib.Path, until_s: float, every_s: float, num_prompts: int,
                   num_samples: int, greedy_at: tuple[float, ...] = ()) -> list[dict]:
  """The run's held-out reward at each scheduled wall-clock point.

  Reads which version was the newest published at each point from the run's
  ``metrics.jsonl`` and evaluates each distinct version once, in one
  ``jax_dora.evaluate`` process (its own servers, after the run): ``reward``
  is the mean over ``num_samples`` temperature-1 samples per prompt (pass@1
  for a 0/1 reward). The points at the times in ``greedy_at`` (and the last
  point) are also decoded greedily (``greedy``), in a second process. Each
  point carries the samples trained into its version (``trained_samples``:
  the per-sample convergence axis).
  """
  recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
  points = rc.scheduled_versions(recs, until_s, every_s)
  versions = sorted({v for _, v in points})
  env = modes_bench._env()  # pylint: disable=protected-access
  by_version = evaluate_versions(run_dir, versions, num_prompts=num_prompts,
                                 num_samples=num_samples, greedy=False,
                                 out=run_dir / "eval_steps.json", env=env)
  want_greedy = {v for t, v in points if any(abs(t - g) < 1e-6 for g in greedy_at)}
  if greedy_at:
    want_greedy.add(points[-1][1])
  greedy = evaluate_versions(run_dir, sorted(want_greedy), num_prompts=num_prompts, num_samples=1,
                             greedy=True, out=run_dir / "eval_greedy.json",
                             env=env) if want_greedy else {}
  rows = rows_per_step(run_dir)
  curve = [{"t": t, "version": v, "reward": by_version[v]["eval/reward"],
            "stderr": by_version[v].get("eval/reward_stderr"), "trained_samples": v * rows,
            **({"greedy": greedy[v]["eval/reward"]} if v in greedy else {})} for t, v in points]
  (run_dir / "eval_curve.json").write_text(json.dumps(curve, indent=1))
  return curve


def trained_staleness(records: list[dict]) -> dict[str, float]:
  """p50 / p99 / mean of the trained samples' staleness (learner version minus the
  version that generated them), pooled from every step's histogram."""
  counts: dict[int, int] = {}
  for r in records:
    for k, n in (r.get("staleness_behaviour") or {}).items():
      if k.lstrip("-").isdigit():
        counts[int(k)] = counts.get(int(k), 0) + int(n)
  total = sum(counts.values())
  if not total:
    return {"p50": float("nan"), "p99": float("nan"), "mean": float("nan")}

  def quantile(q: float) -> float:
    seen = 0
    for k in sorted(counts):
      seen += counts[k]
      if seen >= q * total:
        return float(k)
    return float(max(counts))

  return {"p50": quantile(0.5), "p99": quantile(0.99),
          "mean": sum(k * n for k, n in counts.items()) / total}


def rejection_shares(summary: dict) -> dict[str, float]:
  """Rejected groups per reason as a share of every completed group (trained + rejected):
  ``zero_variance`` (dynamic sampling), ``stale`` (the hard bound) and ``pace`` (the rest:
  PACE's reasons)."""
  rejected = dict(summary.get("rejected_groups") or {})
  total = int(summary.get("trained_groups") or 0) + sum(int(v) for v in rejected.values())
  pace = sum(int(v) for k, v in rejected.items() if k not in ("zero_variance", "stale"))
  share = lambda n: n / total if total else float("nan")  # noqa: E731
  return {"zero_variance": share(int(rejected.get("zero_variance", 0))),
          "stale": share(int(rejected.get("stale", 0))), "pace": share(pace)}


def run_one(mode: str, seed: int, out: pathlib.Path, budget_s: float, every_s: float,
            a: argparse.Namespace, overrides: list[str], greedy_at: tuple[float, ...] = ()) -> dict:
  """One mode's run and its evaluated curve; ``out/result.json`` keeps it, so a
  rerun of the same command (``--out`` given) skips finished runs and redoes a
  run that was cut off (a multi-hour benchmark survives an interrupted session)."""
  done = out / "result.json"
  if done.exists():
    result = json.loads(done.read_text())
    print(f"  {mode:<17} seed {seed}: done before ({done})", flush=True)
    return result
  shutil.rmtree(out, ignore_errors=True)  # a run cut off midway starts again
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
  curve = evaluate_curve(out, budget_s, every_s, a.eval_prompts, a.eval_samples, greedy_at)
  if not a.keep_snapshots:
    shutil.rmtree(out / "snapshots", ignore_errors=True)
  records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
  print(f"  {mode:<17} seed {seed}: {summary['steps']:>4} steps,"
        f" {summary['trained_tokens_per_s']:>6.0f} tok/s, bubble {summary['bubble_ratio']:.0%},"
        f" reward {curve[0]['reward']:.3f} -> {curve[-1]['reward']:.3f}"
        f" (run {trained_s:.0f}s + eval {time.time() - t0 - trained_s:.0f}s)", flush=True)
  result = {"mode": mode, "seed": seed, "run_dir": str(out), "curve": curve,
            "steps": summary["steps"], "trained_tokens_per_s": summary["trained_tokens_per_s"],
            "bubble_ratio": summary["bubble_ratio"], "wasted_share": summary["wasted_share"],
            "staleness": trained_staleness(records), "rejected": rejection_shares(summary),
            "integrity_violations": len(summary.get("integrity_violations") or [])}
  done.write_text(json.dumps(result, indent=1))
  return result


def _fmt(ms: tuple[float, float], spec: str = ".3f") -> str:
  m, se = ms
  if m != m:
    return "n/a"
  return f"{m:{spec}}" + (f" ± {se:{spec}}" if se == se else "")


def print_table(summary: dict, budget_s: float) -> None:
  print(f"\n{'mode':<22}{'reached':>8}{'time to target s':>20}{'dev-s x sync':>16}"
        f"{'reward at B':>18}{'mean R over [0,B]':>20}")
  for mode, row in summary.items():
    print(f"{mode:<22}{row['reached']:>4}/{row['seeds']:<3}{_fmt(row['time_to_target_s'], '.0f'):>20}"
          f"{_fmt(row['x_ref_device_s'], '.2f'):>16}{_fmt(row['reward_at_budget']):>18}"
          f"{_fmt(row['mean_reward_to_budget']):>20}")
  targets = next(iter(summary.values()))["targets"]
  print(f"\ntargets (sync's final held-out reward at B = {budget_s:.0f}s, per seed):"
        f" {', '.join(f'{t:.3f}' for t in targets)}")


def _mean_se(values: list[float]) -> tuple[float, float]:
  vals = [v for v in values if v is not None and v == v]
  return rc.mean_se(vals) if vals else (float("nan"), float("nan"))


def run_stats(runs: list[dict], budget_s: float) -> dict[str, dict]:
  """Per mode, mean ± standard error over seeds of what each run measured besides its
  curve: reward at its own end, greedy reward at B, trained tok/s, bubble, staleness of
  the trained samples, rejected shares and waste; and the reward at B over
  ``async_unfiltered``'s of the same seed and variant (the PACE paper's equal-wall-clock
  comparison, ``x unfiltered at B``)."""
  def at(run: dict, t: float, key: str = "reward") -> float | None:
    pts = [p for p in run["curve"] if p["t"] <= t + 1e-9]
    return pts[-1].get(key) if pts else None

  by_key = {(r["mode"], r["seed"]): r for r in runs}
  stats: dict[str, dict] = {}
  for mode in dict.fromkeys(r["mode"] for r in runs):
    mine = [r for r in runs if r["mode"] == mode]
    variant = mode.partition("@")[2]
    ref_mode = "async_unfiltered" + (f"@{variant}" if variant else "")
    ratios = [at(r, budget_s) / at(by_key[(ref_mode, r["seed"])], budget_s)
              for r in mine if (ref_mode, r["seed"]) in by_key
              and at(by_key[(ref_mode, r["seed"])], budget_s)]
    stats[mode] = {
        "reward_at_end": _mean_se([r["curve"][-1]["reward"] for r in mine]),
        "greedy_at_budget": _mean_se([at(r, budget_s, "greedy") for r in mine]),
        "trained_tokens_per_s": _mean_se([r["trained_tokens_per_s"] for r in mine]),
        "bubble": _mean_se([r["bubble_ratio"] for r in mine]),
        "staleness_p50": _mean_se([(r.get("staleness") or {}).get("p50") for r in mine]),
        "staleness_p99": _mean_se([(r.get("staleness") or {}).get("p99") for r in mine]),
        "pace_rejected": _mean_se([(r.get("rejected") or {}).get("pace") for r in mine]),
        "stale_evicted": _mean_se([(r.get("rejected") or {}).get("stale") for r in mine]),
        "wasted_share": _mean_se([r["wasted_share"] for r in mine]),
        "x_unfiltered_at_budget": _mean_se(ratios),
        "integrity_violations": sum(r["integrity_violations"] for r in mine),
    }
  return stats


def print_run_stats(stats: dict[str, dict]) -> None:
  print(f"\n{'mode':<22}{'R at end':>15}{'greedy at B':>15}{'x unfilt. at B':>16}{'tok/s':>12}"
        f"{'bubble':>13}{'stale p50/p99':>15}{'PACE rej.':>11}{'evicted':>9}{'wasted':>9}"
        f"{'violations':>11}")
  for mode, s in stats.items():
    print(f"{mode:<22}{_fmt(s['reward_at_end']):>15}{_fmt(s['greedy_at_budget']):>15}"
          f"{_fmt(s['x_unfiltered_at_budget'], '.2f'):>16}{_fmt(s['trained_tokens_per_s'], '.0f'):>12}"
          f"{_fmt(s['bubble'], '.2f'):>13}"
          f"{s['staleness_p50'][0]:>8.1f}/{s['staleness_p99'][0]:<6.1f}"
          f"{s['pace_rejected'][0]:>11.1%}{s['stale_evicted'][0]:>9.1%}{s['wasted_share'][0]:>9.1%}"
          f"{s['integrity_violations']:>11}")
  print("(R at end: each mode's reward at its own budget; rejected and evicted: shares of the"
        " completed groups; wasted: generated tokens never trained, dynamic sampling's drops"
        " included)")


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
  result["run_stats"] = run_stats(result["runs"], result["budget_s"])
  print_run_stats(result["run_stats"])
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
  ap.add_argument("--others_factor", type=float, default=2.0,
                  help="the other modes train for this many B (a mode slower than sync does not"
                       " reach the target within it: reported as not reached)")
  ap.add_argument("--greedy", action="store_true",
                  help="also decode greedily at 0, B and each run's end (reported beside pass@1)")
  ap.add_argument("--out", default="", help="directory for the runs (default: temp); rerunning"
                       " the same command with the same --out skips the runs already finished")
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
        f"{', '.join(others)} for {a.others_factor:g}B; held-out reward every {every:.0f}s of each run's clock"
        f" ({a.eval_prompts} prompts x {a.eval_samples}), evaluated after each run;"
        f" {a.seeds} seed(s); placement {a.placement}", flush=True)
  greedy_at = (0.0, budget) if a.greedy else ()
  started = time.strftime("%Y-%m-%d %H:%M")
  path = base / "time_to_reward.json"
  runs: list[dict] = []
  result: dict = {}
  for seed in range(a.seeds):
    order = ["sync", *others]
    random.Random(seed).shuffle(order)
    print(f"seed {seed}: {', '.join(order)}", flush=True)
    for mode in order:
      b = budget if mode == "sync" else a.others_factor * budget
      runs.append(run_one(mode, seed, base / f"seed{seed}" / mode, b, every, a,
                          overrides + variants.get(mode.partition("@")[2], []), greedy_at))
    # The table so far after every seed (a long benchmark's partial answer survives).
    summary = _summarize(runs, ["sync", *others], budget, devices, a.target_points)
    print_table(summary, budget)
    stats = run_stats(runs, budget)
    print_run_stats(stats)
    result = {"workload": modes_bench.CONFIG, "overrides": overrides, "budget_s": budget,
              "others_budget_s": a.others_factor * budget, "every_s": every,
              "target_points": a.target_points, "seeds": seed + 1, "placement": a.placement,
              "devices_per_run": devices, "eval_prompts": a.eval_prompts, "variants": variants,
              "eval_samples": a.eval_samples, "date": started,
              "finished": time.strftime("%Y-%m-%d %H:%M"), "summary": summary, "run_stats": stats, "runs": runs}
    path.write_text(json.dumps(result, indent=1))
  print(f"\n{path}\nfigure: python -m jax_dora.report --curves {path} -o reward_curves.png")
  return result


if __name__ == "__main__":
  main()
