"""``python -m jax_dora.audit RUN_DIR``: re-verify a finished run from its directory alone.

What it checks, after the training process is gone:

* bookkeeping: the trained-sample log replayed through the integrity ledger
  (every sample trained once, groups complete, staleness bounded);
* snapshots: every version still on disk restored and checked against the
  checksums its publisher recorded;
* version labels: the audit sample's spans (``audit_sample.jsonl``, written
  during the run: ``audit.verify_fraction`` of the trained trajectories)
  recomputed on this machine's devices under the snapshot of the version each
  claims; spans of versions no longer on disk are counted as unverifiable
  (``snapshots.max_to_keep=0`` keeps every version);
* rewards: the sample re-scored through the run's reward functions.

``--fraction`` re-verifies that share of the sample (1.0: all of it).
``--separation`` also recomputes each span under the adjacent versions, the
measurement that says whether ``audit.label_tolerance`` separates a right
label from a wrong one. Exit status 0 when nothing is wrong, 3 otherwise,
2 for an unreadable run directory.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
from typing import Any


class AuditError(ValueError):
  """The run directory cannot be audited (no config, no log)."""


def _learner(cfg: Any, policy: Any) -> Any:
  """A learner like the run's, on this machine's devices, to run the training forward."""
  import jax  # pylint: disable=g-import-not-at-top

  from jax_dora.learner.mesh import make_mesh  # pylint: disable=g-import-not-at-top
  from jax_dora.learner.train_state import Learner  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  n = cfg.learner.num_devices if 0 < cfg.learner.num_devices <= len(devices) else len(devices)
  mesh = make_mesh(devices[:n], cfg.learner.mesh_data, cfg.learner.mesh_fsdp,
                   cfg.learner.mesh_tensor, cfg.learner.mesh_expert)
  return Learner(policy.model_cfg, cfg.learner, mesh, temperature=cfg.rollout.temperature,
                 seed=cfg.seed, suppress_mask=policy.suppress_mask)


def separation(label_audit: Any, sample: list[Any]) -> dict[str, list[float]]:
  """Mean |stored - recomputed| per (trajectory, labelled version), under the labelled version
  and under its neighbours: ``{"claimed": [...], "previous": [...], "next": [...]}``."""
  from jax_dora.audit.labels import recompute  # pylint: disable=g-import-not-at-top

  reader, learner = label_audit.reader, label_audit.learner
  on_disk = set(reader.versions())
  by_label: dict[int, list[Any]] = collections.defaultdict(list)
  for t in sample:
    for v in {s.version for s in t.spans}:
      by_label[v].append(t)
  out: dict[str, list[float]] = {"claimed": [], "previous": [], "next": []}
  for under in sorted(on_disk):
    try:
      params, _ = reader.load(under, target=learner.params_target())
    except Exception:  # pylint: disable=broad-except
      continue  # unreadable: reported by the snapshot check
    for label, name in ((under, "claimed"), (under + 1, "previous"), (under - 1, "next")):
      # Tokens labelled ``label`` under version ``under``: the label's own version, the
      # one before it (as if mislabelled one newer), or the one after.
      if by_label.get(label):
        checks = recompute(learner, params, by_label[label], label,
                           seq_buckets=label_audit.seq_buckets, pad_id=label_audit.pad_id,
                           max_rows=label_audit.max_rows)
        out[name] += [c.mean_abs for c in checks]
    del params
  return out


def audit_run(run_dir: str, *, fraction: float = 1.0, measure_separation: bool = False,
              seed: int = 0) -> dict[str, Any]:
  """Every offline check of ``run_dir``; the verdict by kind, counts and messages."""
  from jax_dora.audit.labels import SNAPSHOTS, VERSION_LABELS, build_label_audit  # pylint: disable=g-import-not-at-top
  from jax_dora.audit.rewards import RewardAudit  # pylint: disable=g-import-not-at-top
  from jax_dora.audit.sample import SAMPLE_FILE, read_sample, subsample  # pylint: disable=g-import-not-at-top
  from jax_dora.config import validate  # pylint: disable=g-import-not-at-top
  from jax_dora.evaluate import load_run_config, snapshot_dir  # pylint: disable=g-import-not-at-top
  from jax_dora.orchestrator.integrity import IntegrityLedger  # pylint: disable=g-import-not-at-top
  from jax_dora.orchestrator.modes import mode_class  # pylint: disable=g-import-not-at-top
  from jax_dora.policy import resolve_policy  # pylint: disable=g-import-not-at-top
  from jax_dora.rewards import RewardScorer  # pylint: disable=g-import-not-at-top
  from jax_dora.snapshots import SnapshotReader  # pylint: disable=g-import-not-at-top

  if not os.path.exists(os.path.join(run_dir, "config.json")):
    raise AuditError(f"{run_dir}: no config.json (is it a run's output_dir?)")
  cfg = validate(load_run_config(run_dir))
  log_path = os.path.join(run_dir, "trained_samples.jsonl")
  if not os.path.exists(log_path):
    raise AuditError(f"{run_dir}: no trained_samples.jsonl (the run never trained a step?)")
  messages: dict[str, list[str]] = collections.defaultdict(list)
  ledger = IntegrityLedger.from_log(
      log_path, group_size=cfg.learner.group_size, max_staleness=cfg.orchestrator.max_staleness,
      allow_multi_version=mode_class(cfg.mode).resumes_rollouts, allow_turn_hops=cfg.turn_hops)
  recorded = ledger.verdict()
  messages["bookkeeping"] = ledger.bookkeeping_violations()

  snaps = snapshot_dir(cfg, run_dir)
  reader = SnapshotReader(snaps)
  versions = reader.versions() if os.path.isdir(snaps) else []
  for v in versions:
    try:
      reader.load(v)
    except Exception as e:  # pylint: disable=broad-except
      messages[SNAPSHOTS].append(f"snapshot version {v}: {type(e).__name__}: {e}")

  sample = subsample(read_sample(os.path.join(run_dir, SAMPLE_FILE)), fraction, seed)
  policy = resolve_policy(cfg)
  learner = _learner(cfg, policy)
  labels = build_label_audit(cfg, snaps, learner, policy.tokenizer)
  if labels.reader is None:  # verify_fraction 0 in the run: still check what is given
    labels.reader = SnapshotReader(snaps)
  labels.keep(sample)
  for kind, message in labels.verify_all():
    messages[kind].append(message)

  rewards = RewardAudit()
  rewards.keep(sample)
  scorer = RewardScorer.from_config(cfg.reward)
  try:
    reward_violations, rescored = asyncio.run(rewards.check(scorer, policy.tokenizer))
  finally:
    scorer.close()
  messages["rewards"] += reward_violations

  report: dict[str, Any] = {
      "run_dir": run_dir,
      "violations": {k: len(messages.get(k, [])) for k in
                     ("bookkeeping", SNAPSHOTS, VERSION_LABELS, "rewards")},
      "recorded_during_run": recorded,
      "checked": {"trained_records": len(ledger.trained_records()),
                  "snapshots_on_disk": len(versions), "sample": len(sample),
                  "labels_checked": labels.checked, "labels_unverifiable": labels.unverifiable,
                  "label_max_mean_abs_diff": labels.largest, "rewards_rescored": rescored},
      "label_tolerance": labels.tolerance,
      "messages": {k: v for k, v in messages.items() if v},
  }
  if measure_separation:
    report["separation"] = _percentiles(separation(labels, sample), labels.tolerance)
  return report


def _percentiles(stats: dict[str, list[float]], tolerance: float) -> dict[str, dict[str, float]]:
  """Each distribution's summary, with the share above ``tolerance`` (flagged)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  return {k: ({"n": len(v), "min": float(np.min(v)), "p10": float(np.percentile(v, 10)),
               "median": float(np.median(v)), "max": float(np.max(v)),
               "flagged": float(np.mean(np.asarray(v) > tolerance))} if v else {"n": 0})
          for k, v in stats.items()}


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jax_dora.audit", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("run_dir")
  ap.add_argument("--fraction", type=float, default=1.0,
                  help="share of the run's audit sample to re-verify (default: all of it)")
  ap.add_argument("--separation", action="store_true",
                  help="also measure each span under the adjacent versions")
  ap.add_argument("--json", action="store_true", help="print the whole report as JSON")
  args = ap.parse_args(argv)
  if not 0 < args.fraction <= 1:
    ap.error("--fraction must be in (0, 1]")
  from jax_dora.runtime import cpu_friendly_env  # pylint: disable=g-import-not-at-top

  cpu_friendly_env()
  try:
    report = audit_run(args.run_dir, fraction=args.fraction,
                       measure_separation=args.separation)
  except (AuditError, OSError) as e:
    print(f"audit error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(report, indent=1))
  else:
    bad = sum(report["violations"].values())
    print(f"{args.run_dir}: {'FAILED' if bad else 'OK'}")
    print("  violations  " + ", ".join(f"{k} {n}" for k, n in report["violations"].items()))
    print("  checked     " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in report["checked"].items()))
    for kind, msgs in report["messages"].items():
      for m in msgs[:5]:
        print(f"  {kind}: {m}")
    for name, p in report.get("separation", {}).items():
      print(f"  separation {name:8s} " + ", ".join(f"{k} {v:.3g}" for k, v in p.items()))
  return 3 if sum(report["violations"].values()) else 0


if __name__ == "__main__":
  sys.exit(main())
