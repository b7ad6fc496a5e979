"""The few lines a person reads when a training run ends.

``summary.json`` holds everything and is meant for programs; this is the
at-a-glance version printed by ``python -m jax_dora.train``: throughput,
learner bubble, staleness percentiles, what PACE rejected, reward before and
after, the integrity verdict, and where the dashboards and the plot are.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from jax_dora.metrics.jsonl import is_remote, read_metrics
from jax_dora.report import ReportError, headline, write_report

log = logging.getLogger(__name__)


def _num(v: Any, fmt: str = ".3f") -> str:
  return "-" if v is None else format(v, fmt)


def _binary_reward(first: dict[str, Any], final: dict[str, Any]) -> bool:
  """Whether the eval reward is pass@1 itself (a 0/1 reward such as ``math_verify``)."""
  pairs = [(d.get("eval/reward"), d.get("eval/pass@1")) for d in (first, final) if d]
  return bool(pairs) and all(r is not None and p is not None and abs(r - p) < 1e-9
                             for r, p in pairs)


def _eval_line(summary: dict[str, Any]) -> tuple[str, str]:
  """The eval line's label and text: before -> after (± se), then the other overall metrics.

  With a 0/1 reward the reward *is* pass@1, so the line is labelled
  ``held-out pass@1`` and says it once; a shaped reward keeps ``eval reward``
  with pass@1 before -> after beside it. Per-task / per-group metrics
  (``eval/<group>/...``) stay in the metrics log: the line must fit a terminal.
  """
  before, after = summary.get("initial_eval_reward"), summary.get("final_eval_reward")
  se = summary.get("final_eval_reward_stderr")
  line = f"{_num(before)} -> {_num(after)}" + (f" (± {se:.3f})" if se is not None else "")
  first, final = summary.get("initial_eval") or {}, summary.get("final_eval") or {}
  binary = _binary_reward(first, final)
  extra = []
  for k, v in final.items():
    name = k.removeprefix("eval/")
    if k == "eval/reward" or "/" in name or k.endswith("_stderr") or v is None:
      continue
    if binary and name == "pass@1":
      continue
    start = first.get(k)
    extra.append(f"{name} {start:.3f} -> {v:.3f}" if name == "pass@1" and start is not None
                 else f"{name} {v:.3f}")
  return ("held-out pass@1" if binary else "eval reward",
          line + (f"; {', '.join(extra)}" if extra else ""))


def format_summary(summary: dict[str, Any], records: list[dict[str, Any]],
                   report_png: str | None = None) -> str:
  """The end-of-run text for ``summary`` (run_training's result) and its metrics records."""
  h = headline(records, summary) if records else {}
  viol = summary.get("integrity_violations") or []
  verdict = ("OK: every sample trained once, rejected with a reason, or carried over"
             if not viol else f"FAILED: {len(viol)} violation(s), first: {viol[0]}")
  audit = summary.get("audit") or {}
  by_kind = audit.get("violations") or {}
  if by_kind:
    verdict += "\n                   by kind: " + ", ".join(f"{k} {n}" for k, n in by_kind.items())
  checked = [f"{audit[k]} {what}" for k, what in (
      ("labels_checked", "version labels recomputed"), ("rewards_rescored", "rewards re-scored"),
      ("snapshots_checked", "snapshots against the learner")) if audit.get(k)]
  if audit.get("labels_unverifiable"):
    checked.append(f"{audit['labels_unverifiable']} labels unverifiable (version retired)")
  if audit.get("labels_skipped"):
    checked.append(f"{audit['labels_skipped']} labels skipped (audit.label_time_share)")
  if checked:
    verdict += "\n                   checked: " + ", ".join(checked)
  rejected = summary.get("rejected_groups") or {}
  eval_label, eval_text = _eval_line(summary)
  lines = [
      (f"== {summary.get('mode')}: {summary.get('steps')} steps in"
       f" {summary.get('wall_time_s', 0.0):.0f}s =="),
      f"trained tokens/s   {_num(summary.get('trained_tokens_per_s'), '.0f')}",
      f"learner bubble     {_num(h.get('bubble'), '.2f')}  (idle share of learner step time)",
      (f"staleness p50/p99  generation {h.get('staleness_generation_p50', '-')}"
       f"/{h.get('staleness_generation_p99', '-')}, waiting {h.get('staleness_waiting_p50', '-')}"
       f"/{h.get('staleness_waiting_p99', '-')} (versions)"),
      (f"rejected groups    PACE {h.get('pace_rejected_groups', 0)}, stale"
       f" {rejected.get('stale', 0)}, zero-variance {rejected.get('zero_variance', 0)}"
       + (f" (trained {summary['trained_groups']})" if summary.get("trained_groups") else "")),
      f"{eval_label:<19}{eval_text}",
      f"integrity          {verdict}",
      f"metrics            {summary.get('metrics_path', '-')}",
  ]
  if summary.get("tensorboard_dir"):
    lines.append(f"TensorBoard        tensorboard --logdir {summary['tensorboard_dir']}")
  if summary.get("wandb_dir"):
    lines.append(f"W&B run            {summary['wandb_dir']}")
  if report_png:
    lines.append(f"plot               {report_png}")
  return "\n".join(lines)


def finish_run(summary: dict[str, Any]) -> str:
  """Writes ``<output_dir>/report.png`` (+ .html) and returns the summary text."""
  out = str(summary.get("output_dir", ""))
  records = read_metrics(summary["metrics_path"]) if summary.get("metrics_path") else []
  png = None
  if out and not is_remote(out) and records:
    try:
      png, _ = write_report([out], os.path.join(out, "report.png"))
    except (ReportError, OSError) as e:  # the run itself succeeded: say so, still summarise
      log.warning("could not write the report: %s", e)
  return format_summary(summary, records, png)
