"""Pools the per-round ratios of two modes over several ``benchmarks/modes.py`` records.

Usage::

  python benchmarks/pool_rounds.py \\
      benchmarks/results/modes_tools_restart_stale_turns.json:async_unfiltered:dora_pace@hop \\
      benchmarks/results/modes_tools_restart_stale_turns_both.json:async_unfiltered@off:dora_pace@off

Each argument is ``RECORD:REF:MODE`` (the names as the record's ``per_round``
keys them: a mode, or ``mode@variant``). Why: one 3-round run of the modes
benchmark gives a ratio whose min-max spans +-10% on this VM, so "is MODE at
least as fast as REF" needs more rounds than one run has. Runs made on other
days with the same workload and the same settings for the two rows are pooled
here rather than rerun: the rounds stay paired (a round's two runs shared a
seed and the machine's state), the ratios are combined on a log scale
(ratios multiply; a 0.9x and a 1.1x round are not "1.0x"), and the table
gives the geometric mean with a 95% t-interval over all rounds. The caller
vouches that the pooled rows ran the same configuration; the script prints
each record's date and overrides so a reader can check.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

from scipy import stats


def t_quantile_975(df: int) -> float:
  """The 97.5% quantile of Student's t with ``df`` degrees of freedom (scipy comes with jax)."""
  return float(stats.t.ppf(0.975, df))


def paired_ratios(record: dict, ref: str, mode: str, metric: str) -> list[float]:
  """``metric`` of ``mode`` over ``metric`` of ``ref``, round by round."""
  rounds = record["per_round"]
  for name in (ref, mode):
    if name not in rounds:
      raise SystemExit(f"{name!r} is not in this record (has {sorted(rounds)})")
  return [m[metric] / r[metric] for r, m in zip(rounds[ref], rounds[mode])]


def pooled(ratios: list[float]) -> dict[str, float]:
  """Geometric mean and its 95% t-interval of ``ratios`` (at least two)."""
  logs = [math.log(x) for x in ratios]
  mean = statistics.mean(logs)
  half = t_quantile_975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
  return {"rounds": len(logs), "geomean": math.exp(mean), "low": math.exp(mean - half),
          "high": math.exp(mean + half), "at_or_above_1": sum(x >= 1 for x in ratios)}


def main(argv: list[str] | None = None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("pairs", nargs="+", metavar="RECORD:REF:MODE")
  ap.add_argument("--metric", default="steps_per_s",
                  help="per-run figure to compare (steps_per_s: trajectories/s at a fixed batch)")
  a = ap.parse_args(argv)
  ratios: list[float] = []
  for spec in a.pairs:
    path, ref, mode = spec.rsplit(":", 2)
    with open(path) as f:
      record = json.load(f)
    got = paired_ratios(record, ref, mode, a.metric)
    rewards = {n: statistics.mean(r["final_eval_reward"] for r in record["per_round"][n])
               for n in (ref, mode)}
    print(f"{path} ({record.get('date')}, {' '.join(record.get('overrides', []))}):"
          f" {mode} / {ref} {a.metric} per round {', '.join(f'{x:.3f}' for x in got)};"
          f" held-out reward {rewards[mode]:.3f} vs {rewards[ref]:.3f}")
    ratios += got
  if len(ratios) < 2:
    raise SystemExit("need at least two rounds to pool")
  out = pooled(ratios)
  print(f"pooled over {out['rounds']} rounds: geometric mean {out['geomean']:.3f},"
        f" 95% interval [{out['low']:.3f}, {out['high']:.3f}],"
        f" {out['at_or_above_1']} of {out['rounds']} rounds at or above 1")
  return out


if __name__ == "__main__":
  main(sys.argv[1:])
