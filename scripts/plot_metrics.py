"""Plots reward, throughput, learner bubble and staleness of runs against wall time.

Usage:
  python scripts/plot_metrics.py [LABEL=]metrics.jsonl ... -o compare.png
      [--panels reward_mean,train/mismatch/kl_k3_stale_gt0,train/is_weight_max]

``--panels`` plots any metric keys instead of the default four (one panel each).

A file given without a label is labelled by its run directory (its ``mode``
field if the records carry one), so ``runs/*/metrics.jsonl`` gives a readable
legend. Wall time is used on the x axis because the modes are compared at equal
time budgets: a mode that takes more, cheaper steps must not look better just
because it has more points.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: CI, TPU VMs, Colab kernels without a display
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# pylint: disable-next=g-import-not-at-top,wrong-import-position
from jax_dora.metrics.jsonl import read_metrics
from jax_dora.report import save_figure

PANELS = (
    ("reward_mean", "train reward (mean)"),
    ("trained_tokens_per_s", "trained tokens / s"),
    ("bubble_ratio", "learner bubble ratio"),
    ("staleness_effective", "effective staleness (mean)"),
)


def _value(rec: dict[str, Any], key: str) -> float | None:
  v = rec.get(key)
  if isinstance(v, dict):  # a staleness histogram
    v = v.get("mean")
  if isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity"):
    return float(v)  # a non-finite metric (jax_dora.metrics.jsonl.to_jsonable)
  return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _wall_time(recs: list[dict[str, Any]]) -> list[float]:
  if all("wall_time_s" in r for r in recs):
    return [float(r["wall_time_s"]) for r in recs]
  t0 = recs[0].get("time", 0.0)
  return [float(r.get("time", t0)) - t0 for r in recs]


def parse_run(arg: str) -> tuple[str, str]:
  """``label=path`` or ``path`` -> (label, path)."""
  if "=" in arg and not os.path.exists(arg):
    label, path = arg.split("=", 1)
    return label, path
  return "", arg


def plot(runs: list[tuple[str, str]], out: str,
         panels: tuple[tuple[str, str], ...] = PANELS) -> None:
  """Writes one PNG with a panel per metric, one line per run."""
  cols = 2 if len(panels) > 1 else 1
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
  for label, path in runs:
    recs = read_metrics(path)
    if not recs:
      print(f"warning: {path} has no records", file=sys.stderr)
      continue
    if not label:
      label = recs[0].get("mode") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    t = _wall_time(recs)
    for ax, (key, _) in zip(axes.flat, panels):
      pts = [(x, _value(r, key)) for x, r in zip(t, recs)]
      pts = [(x, y) for x, y in pts if y is not None]
      if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker=".", ms=3)
  for ax in list(axes.flat)[len(panels):]:
    ax.set_visible(False)
  for ax, (_, title) in zip(axes.flat, panels):
    ax.set_title(title)
    ax.set_xlabel("wall time (s)")
  save_figure(fig, list(axes.flat)[:len(panels)], out, dpi=100)


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("runs", nargs="+", help="metrics.jsonl files, optionally LABEL=PATH")
  ap.add_argument("-o", "--output", default="metrics.png", help="PNG file to write")
  ap.add_argument("--panels", default="", help="comma-separated metric keys (default: reward,"
                  " throughput, bubble, effective staleness)")
  a = ap.parse_args(argv)
  panels = tuple((k, k) for k in a.panels.split(",") if k) or PANELS
  plot([parse_run(r) for r in a.runs], a.output, panels)
  print(a.output)


if __name__ == "__main__":
  main()
