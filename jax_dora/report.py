"""One picture comparing runs: ``python -m jax_dora.report RUN_DIR [RUN_DIR...]``.

Writes a PNG (and an HTML page embedding it, with each run's headline
numbers) of reward against wall clock, trained tokens/s, the learner bubble
and the staleness distributions of every run given. Wall clock, not steps,
is the x axis because the modes are compared at equal time budgets: a mode
taking more, cheaper steps must not look better for having more points.

Reads only ``metrics.jsonl`` and ``summary.json`` of each run directory, so
it works on runs copied off a TPU VM without the training stack's devices.

``python -m jax_dora.report --curves time_to_reward.json`` draws instead the
held-out reward against wall clock of ``benchmarks/time_to_reward.py``'s runs:
per mode the mean over seeds with the seeds' range as a band, each seed's
target (sync's final reward at its budget) as a dotted line and the budget marked.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from jax_dora.metrics.histogram import histogram_counts
from jax_dora.metrics.jsonl import read_metrics

STALENESS_PANELS = (
    ("staleness_generation", "generation staleness (versions)"),
    ("staleness_waiting", "waiting staleness (versions)"),
    ("staleness_effective", "effective staleness (versions)"),
)


class ReportError(ValueError):
  """A run directory without the files a report needs."""


def load_run(run_dir: str) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
  """(label, metrics records, summary or {}) of one run directory."""
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    raise ReportError(f"{run_dir}: no metrics.jsonl (is it a run's output_dir?)")
  recs = read_metrics(path)
  if not recs:
    raise ReportError(f"{path} has no records: the run logged no learner step")
  summary_path = os.path.join(run_dir, "summary.json")
  summary: dict[str, Any] = {}
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  name = os.path.basename(os.path.abspath(run_dir))
  mode = recs[0].get("mode") or summary.get("mode") or ""
  label = name if not mode or mode == name else f"{name} ({mode})"
  return label, recs, summary


def total_histogram(recs: Sequence[dict[str, Any]], key: str) -> dict[int, int]:
  """A staleness histogram summed over every step's records (the run's distribution)."""
  out: dict[int, int] = {}
  for r in recs:
    h = r.get(key)
    if isinstance(h, dict):
      for b, c in histogram_counts(h).items():
        out[b] = out.get(b, 0) + c
  return out


def percentile(counts: dict[int, int], q: float) -> int | None:
  """Nearest-rank ``q``-th percentile (0 < q <= 100) of integer bucket counts."""
  n = sum(counts.values())
  if not n:
    return None
  need, seen = q / 100.0 * n, 0
  for b in sorted(counts):
    seen += counts[b]
    if seen >= need:
      return b
  return max(counts)


def _wall(recs: Sequence[dict[str, Any]]) -> list[float]:
  return [float(r.get("wall_time_s", 0.0)) for r in recs]


def plot_runs(run_dirs: Sequence[str], out_png: str) -> list[tuple[str, list, dict]]:
  """Writes the comparison PNG; returns the loaded runs."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")  # headless: CI, TPU VMs, notebook kernels without a display
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top,unused-import

  runs = [load_run(d) for d in run_dirs]
  fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
  ax_r, ax_t, ax_b = axes[0]
  for i, (label, recs, _) in enumerate(runs):
    color = f"C{i}"
    t = _wall(recs)
    ax_r.plot(t, [r["reward_mean"] for r in recs], color=color, label=f"{label} train", lw=1)
    ev = [(x, r["eval_reward"]) for x, r in zip(t, recs) if r.get("eval_reward") is not None]
    if ev:
      ax_r.plot([e[0] for e in ev], [e[1] for e in ev], color=color, ls="--", marker="o", ms=4,
                label=f"{label} eval")
    ax_t.plot(t, [r["trained_tokens_per_s"] for r in recs], color=color, label=label)
    ax_b.plot(t, [r["bubble_ratio"] for r in recs], color=color, label=label)
  width = 0.8 / max(len(runs), 1)
  for ax, (key, title) in zip(axes[1], STALENESS_PANELS):
    for i, (label, recs, _) in enumerate(runs):
      counts = total_histogram(recs, key)
      n = sum(counts.values())
      if n:
        xs = sorted(counts)
        ax.bar([x + (i - (len(runs) - 1) / 2) * width for x in xs],
               [counts[x] / n for x in xs], width=width, color=f"C{i}", label=label)
    ax.set_title(title)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("versions")
    ax.set_ylabel("share of trained samples")
  for ax, title, ylabel in ((ax_r, "reward vs wall clock", "reward"),
                            (ax_t, "trained tokens / s", "tokens / s"),
                            (ax_b, "learner bubble (idle share of step)", "bubble ratio")):
    ax.set_title(title)
    ax.set_xlabel("wall clock (s)")
    ax.set_ylabel(ylabel)
  save_figure(fig, axes.flat, out_png, dpi=90)
  return runs


def _mean_curve(curves: list[list[dict]], x_key: str) -> tuple[list[float], list[list[float]]]:
  """Per scheduled point (the shortest seed sets how many): the seeds' mean x (``t`` is the same
  for every seed; ``trained_samples`` is not) and every seed's reward."""
  n = min(len(c) for c in curves)
  return ([sum(c[k][x_key] for c in curves) / len(curves) for k in range(n)],
          [[c[k]["reward"] for c in curves] for k in range(n)])


def plot_reward_curves(result: dict[str, Any], out_png: str) -> None:
  """Held-out reward vs wall clock per mode: mean over seeds, the seeds' range
  as a band, the target and the budget marked (``time_to_reward.json``).

  When the curves carry ``trained_samples``, a second panel draws the reward
  against the samples trained into each version for ``sync`` and the
  ``dora_pace`` runs: DORA's claim is that its speed costs no convergence per
  sample, which the wall-clock panel cannot show."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  runs = result.get("runs") or []
  if not runs:
    raise ReportError("the time-to-reward result has no runs")
  by_mode: dict[str, list[list[dict]]] = {}
  for r in runs:
    by_mode.setdefault(r["mode"], []).append(r["curve"])
  per_sample = all("trained_samples" in p for r in runs for p in r["curve"])
  fig, axes = plt.subplots(1, 2 if per_sample else 1, figsize=(15 if per_sample else 9, 5.5),
                           squeeze=False)
  ax = axes[0][0]
  colors = {mode: f"C{i}" for i, mode in enumerate(by_mode)}
  for mode, curves in by_mode.items():
    ts, vals = _mean_curve(curves, "t")
    mean = [sum(v) / len(v) for v in vals]
    ax.plot(ts, mean, color=colors[mode], marker="o", ms=3, label=f"{mode} (mean of {len(curves)})")
    if len(curves) > 1:
      ax.fill_between(ts, [min(v) for v in vals], [max(v) for v in vals], color=colors[mode],
                      alpha=0.15, lw=0)
  targets = next(iter(result.get("summary", {}).values()), {}).get("targets") or []
  for j, tg in enumerate(targets):
    ax.axhline(tg, color="gray", ls=":", lw=1, label="target (sync's final reward), per seed"
               if j == 0 else None)
  if result.get("budget_s"):
    ax.axvline(float(result["budget_s"]), color="black", ls="--", lw=1, label="B")
  ax.set_title(f"held-out reward vs wall clock ({result.get('workload', '')}, band: seeds' range)")
  ax.set_xlabel("training wall clock (s; evaluation excluded)")
  ax.set_ylabel("held-out reward")
  used = [ax]
  if per_sample:
    ax2 = axes[0][1]
    for mode, curves in by_mode.items():
      if mode != "sync" and not mode.startswith("dora_pace"):
        continue
      xs, vals = _mean_curve(curves, "trained_samples")
      # Seeds trained different sample counts by each scheduled time: each seed's own line.
      for c in curves:
        ax2.plot([p["trained_samples"] for p in c], [p["reward"] for p in c], color=colors[mode],
                 alpha=0.3, lw=1)
      ax2.plot(xs, [sum(v) / len(v) for v in vals], color=colors[mode], marker="o", ms=3,
               label=f"{mode} (thin: each seed; thick: the seeds' mean)")
    ax2.set_title("held-out reward vs samples trained (convergence per sample)")
    ax2.set_xlabel("trained samples in the evaluated version")
    ax2.set_ylabel("held-out reward")
    used.append(ax2)
  save_figure(fig, used, out_png, dpi=100)


def save_figure(fig, axes, out: str, dpi: int) -> None:
  """Grid and legend on every panel, then writes ``out`` (its folder created)
  and closes the figure (the report and ``scripts/plot_metrics.py`` share it)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  for ax in axes:
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=dpi)
  plt.close(fig)


def headline(recs: Sequence[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
  """The numbers a person reads first, from a run's records and summary."""
  wait = sum(float(r.get("learner_wait_s", 0.0)) for r in recs)
  total = sum(float(r.get("step_time_s", 0.0)) for r in recs)
  gen = total_histogram(recs, "staleness_generation")
  waiting = total_histogram(recs, "staleness_waiting")
  rejected = summary.get("rejected_groups") or {}
  return {
      "mode": summary.get("mode") or recs[-1].get("mode"),
      "steps": summary.get("steps", recs[-1]["step"]),
      "trained_tokens_per_s": summary.get("trained_tokens_per_s",
                                          recs[-1].get("trained_tokens_per_s")),
      "bubble": wait / total if total > 0 else None,
      "staleness_generation_p50": percentile(gen, 50),
      "staleness_generation_p99": percentile(gen, 99),
      "staleness_waiting_p50": percentile(waiting, 50),
      "staleness_waiting_p99": percentile(waiting, 99),
      "pace_rejected_groups": sum(v for k, v in rejected.items() if k.startswith("pace")),
      "stale_evicted_groups": rejected.get("stale", 0),
      "initial_eval_reward": summary.get("initial_eval_reward"),
      "final_eval_reward": summary.get("final_eval_reward"),
      "integrity_violations": len(summary.get("integrity_violations") or []),
  }


def _fmt(v: Any) -> str:
  if v is None:
    return "-"
  return f"{v:.3f}" if isinstance(v, float) else str(v)


def write_html(runs: Sequence[tuple[str, list, dict]], png: str, out_html: str) -> None:
  """An HTML page with the PNG inlined and a table of each run's headline numbers."""
  rows = [(label, headline(recs, summary)) for label, recs, summary in runs]
  keys = list(rows[0][1]) if rows else []
  head = "".join(f"<th>{html.escape(k)}</th>" for k in ["run", *keys])
  body = "".join(
      "<tr>" + f"<td>{html.escape(label)}</td>"
      + "".join(f"<td>{html.escape(_fmt(h[k]))}</td>" for k in keys) + "</tr>"
      for label, h in rows)
  with open(png, "rb") as f:
    img = base64.b64encode(f.read()).decode()
  with open(out_html, "w") as f:
    f.write("<!doctype html><meta charset='utf-8'><title>jax-dora report</title>"
            "<style>body{font-family:sans-serif}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}</style>"
            f"<h1>jax-dora runs</h1><table><tr>{head}</tr>{body}</table>"
            f"<p><img src='data:image/png;base64,{img}' style='max-width:100%'></p>")


def write_report(run_dirs: Sequence[str], out_png: str) -> tuple[str, str]:
  """Writes ``out_png`` and the HTML page beside it; returns both paths."""
  if not run_dirs:
    raise ReportError("no run directory given")
  runs = plot_runs(run_dirs, out_png)
  out_html = os.path.splitext(out_png)[0] + ".html"
  write_html(runs, out_png, out_html)
  return out_png, out_html


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jax_dora.report",
                               description=__doc__.splitlines()[0])
  ap.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="run output directories")
  ap.add_argument("--curves", default="", metavar="JSON",
                  help="draw benchmarks/time_to_reward.py's result (time_to_reward.json) instead")
  ap.add_argument("-o", "--output", default="",
                  help="PNG to write (default: RUN_DIR/report.png for one run, report.png for"
                  " several); the HTML page goes beside it")
  a = ap.parse_args(argv)
  if a.curves:
    out = a.output or os.path.splitext(a.curves)[0] + ".png"
    try:
      with open(a.curves) as f:
        plot_reward_curves(json.load(f), out)
    except (OSError, ValueError, KeyError, ReportError) as e:
      print(f"report error: {a.curves}: {e}", file=sys.stderr)
      return 2
    print(out)
    return 0
  if not a.run_dirs:
    ap.error("give RUN_DIR(s) or --curves JSON")
  out = a.output or (os.path.join(a.run_dirs[0], "report.png") if len(a.run_dirs) == 1
                     else "report.png")
  try:
    png, page = write_report(a.run_dirs, out)
  except ReportError as e:
    print(f"report error: {e}", file=sys.stderr)
    return 2
  print(png)
  print(page)
  return 0


if __name__ == "__main__":
  sys.exit(main())
