"""Does off-policy correction pay off as staleness grows? A side-by-side sweep.

Runs ``dora`` and ``async_unfiltered`` on the long-tailed benchmark workload
(``configs/long_tail.py``, the one ``benchmarks/modes.py`` uses) at
``orchestrator.max_staleness`` in {1, 4, 8, 16}, each with three losses:

* ``grpo``: PPO clipping of pi / pi_behaviour (no correction);
* ``decoupled_ppo``: AReaL's decoupled objective (clip against the learner's
  current policy, importance weight pi_prox / pi_behaviour);
* ``grpo+tis``: GRPO with the behaviour part of the ratio truncated at
  ``learner.tis_cap``.

Every run gets the same wall-clock budget, so the table compares held-out
reward *at equal wall clock*, with its standard error across seeds (training
noise included). To make high staleness actually happen, the producer fills
the whole staleness budget (``orchestrator.fill_staleness_budget``: up to
``(max_staleness + 1)`` batches in flight instead of what the slots can work
on) and the servers may hold ``min(max_staleness + 1, 6)`` versions; the table
reports the staleness the runs really reached (token-weighted mean and max
behaviour staleness of the trained data), and the learner-vs-behaviour
mismatch (mean k3 KL over steps, for tokens of the current version and of
older versions) with the largest importance weight seen.

Usage: python benchmarks/staleness_sweep.py [--budget_s 30] [--seeds 2]
           [--staleness 1,4,8,16] [--modes dora,async_unfiltered]
           [--losses grpo,decoupled_ppo,grpo+tis] [--placement split|shared]
           [--config.x=y ...]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import modes as modes_bench  # noqa: E402  pylint: disable=g-import-not-at-top

# Servers hold at most this many versions (each count is one decode compile);
# staleness beyond it still arises from pool waiting and pending loads.
MAX_SERVER_VERSIONS = 6

LOSSES: dict[str, list[str]] = {
    "grpo": ["--config.learner.loss=grpo"],
    "decoupled_ppo": ["--config.learner.loss=decoupled_ppo"],
    "grpo+tis": ["--config.learner.loss=grpo", "--config.learner.is_correction=tis"],
}


def _mean(xs: list[float]) -> float:
  xs = [x for x in xs if x is not None and math.isfinite(x)]
  return statistics.mean(xs) if xs else float("nan")


def run_metrics(out: pathlib.Path) -> dict[str, float]:
  """Realised staleness and mismatch of one run, from its metrics log."""
  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
  beh = [r["staleness_behaviour"] for r in recs]
  return {
      "staleness_mean": _mean([h.get("mean") for h in beh]),
      "staleness_max": max((h.get("max", 0) for h in beh), default=0),
      "kl_stale0": _mean([r.get("train/mismatch/kl_k3_stale0") for r in recs]),
      "kl_stale_gt0": _mean([r.get("train/mismatch/kl_k3_stale_gt0") for r in recs
                             if r.get("train/stale_token_frac", 0) > 0]),
      "is_weight_max": max((r.get("train/is_weight_max", 0.0) for r in recs), default=0.0),
  }


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--budget_s", type=float, default=30.0, help="training wall clock per run")
  ap.add_argument("--seeds", type=int, default=2)
  ap.add_argument("--staleness", default="1,4,8,16")
  ap.add_argument("--modes", default="dora,async_unfiltered")
  ap.add_argument("--losses", default=",".join(LOSSES))
  ap.add_argument("--placement", choices=("split", "shared"), default="split")
  ap.add_argument("--out", default="")
  a, overrides = ap.parse_known_args(argv)
  bad = [o for o in overrides if not o.startswith("--config.")]
  unknown = [x for x in a.losses.split(",") if x not in LOSSES]
  if bad or unknown:
    ap.error(f"unrecognized {bad or unknown} (config overrides look like --config.x=y;"
             f" losses are {list(LOSSES)})")
  base = pathlib.Path(a.out or tempfile.mkdtemp(prefix="jax_dora_staleness_"))
  grid = [(m, int(s), l) for m in a.modes.split(",") for s in a.staleness.split(",")
          for l in a.losses.split(",")]
  print(f"workload {modes_bench.CONFIG}; {len(grid)} settings x {a.seeds} seeds,"
        f" {a.budget_s:.0f}s each; placement {a.placement}", flush=True)
  runs: dict[tuple, list[dict]] = {g: [] for g in grid}
  for seed in range(a.seeds):
    for mode, s, loss in grid:
      out = base / f"{mode}_s{s}_{loss}_seed{seed}"
      print(f"running {mode} max_staleness={s} {loss} (seed {seed}) ...", flush=True)
      extra = overrides + LOSSES[loss] + [
          f"--config.orchestrator.max_staleness={s}",
          "--config.orchestrator.fill_staleness_budget=True",
          f"--config.rollout.max_versions={min(s + 1, MAX_SERVER_VERSIONS)}",
          f"--config.seed={seed}",
      ]
      summary = modes_bench.run_mode(mode, out, a.budget_s, extra, a.placement)
      runs[(mode, s, loss)].append(dict(summary, **run_metrics(out)))
  print()
  print(f"{'mode':<17}{'s_max':>6}{'loss':>15}{'steps':>6}{'eval R':>8}{'± se':>7}"
        f"{'stale mean':>11}{'max':>5}{'KL s=0':>10}{'KL s>0':>10}{'w max':>8}{'viol':>5}")
  table = {}
  for (mode, s, loss), rs in runs.items():
    evals = [r["final_eval_reward"] for r in rs if r.get("final_eval_reward") is not None]
    if len(evals) > 1:
      se = statistics.stdev(evals) / len(evals) ** 0.5
    else:
      se = rs[0].get("final_eval_reward_stderr") or float("nan")
    row = {
        "steps": _mean([r["steps"] for r in rs]), "eval": _mean(evals), "se": se,
        "staleness_mean": _mean([r["staleness_mean"] for r in rs]),
        "staleness_max": max(r["staleness_max"] for r in rs),
        "kl_stale0": _mean([r["kl_stale0"] for r in rs]),
        "kl_stale_gt0": _mean([r["kl_stale_gt0"] for r in rs]),
        "is_weight_max": max(r["is_weight_max"] for r in rs),
        "violations": sum(len(r["integrity_violations"]) for r in rs),
    }
    table[f"{mode}/s{s}/{loss}"] = row
    print(f"{mode:<17}{s:>6}{loss:>15}{row['steps']:>6.0f}{row['eval']:>8.3f}{row['se']:>7.3f}"
          f"{row['staleness_mean']:>11.2f}{row['staleness_max']:>5}{row['kl_stale0']:>10.2e}"
          f"{row['kl_stale_gt0']:>10.2e}{row['is_weight_max']:>8.2f}{row['violations']:>5}")
  (base / "staleness_sweep.json").write_text(json.dumps(table, indent=1))
  print(f"\nruns in {base}; table in {base}/staleness_sweep.json")
  return table


if __name__ == "__main__":
  main()
