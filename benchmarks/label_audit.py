"""What separates a right version label from a wrong one: the audit's label statistic measured.

Usage::

  python benchmarks/label_audit.py              # 3 runs of 12 dora_pace steps, ~3 min on 2 CPU cores
  python benchmarks/label_audit.py --steps 4    # a smoke run

The audit (``jax_dora.audit.labels``) recomputes a span's behaviour log-probs
under the snapshot of the version it claims and flags it when the mean
absolute difference from the stored ones exceeds ``audit.label_tolerance``.
That only works if the statistic under the *claimed* version (engine vs
training forward: rounding) sits well below the statistic under an
*adjacent* version (what a label off by one would show: one learner step of
policy change). This trains the tiny policy (``configs/tiny.py``) in
``dora_pace`` with every trajectory in the audit sample and every snapshot
kept, then, offline (``python -m jax_dora.audit --separation``), recomputes
every span under its claimed version and under the versions just before and
after it, in three numeric settings:

* ``float32``: float32 activations and parameters on both sides;
* ``bf16-act``: bfloat16 activations on both sides (``model.dtype``);
* ``bf16-act+params``: and the servers hold bfloat16 parameters
  (``rollout.param_dtype``), the usual accelerator setting.

It prints, per setting, the distribution of the statistic under the claimed
and the adjacent versions, the margin (smallest adjacent / largest claimed)
and the share of right labels (false alarms) and of off-by-one labels the
precision's default tolerance flags (``jax_dora.audit.labels.label_tolerance``).

Prediction (written before the run): float32 claims ~1e-7 (the two programs
agree to rounding); a one-step neighbour differs by the policy's change per
step at the tiny model's learning rate, ~1e-2. bfloat16 activations put the
claimed statistic near 1e-2, the same order as the neighbours, so a single
span cannot be judged there at this learning rate; a tolerance for bfloat16
must come from this measurement, not from float32's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_dora.config import base_config  # noqa: E402  pylint: disable=wrong-import-position

SETTINGS = {
    "float32": {},
    "bf16-act": {"model.dtype": "bfloat16"},
    "bf16-act+params": {"model.dtype": "bfloat16", "rollout.param_dtype": "bfloat16"},
}


def setting_config(setting: str, steps: int, seed: int, out: str):
  c = base_config()
  c.mode = "dora_pace"
  c.seed = seed
  c.total_steps = steps
  c.output_dir = out
  c.progress_bar = False
  c.precompile = False
  c.eval.num_prompts = 0
  c.eval.at_start = False
  c.snapshots.max_to_keep = 0  # every version stays for the offline recomputation
  c.audit.verify_fraction = 1.0
  c.audit.label_time_share = 1.0
  for key, value in SETTINGS[setting].items():
    block, name = key.split(".")
    setattr(getattr(c, block), name, value)
  return c


def main(argv=None) -> dict[str, dict]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--settings", default=",".join(SETTINGS))
  ap.add_argument("--json", default="", help="also write the table here")
  args = ap.parse_args(argv)
  from jax_dora.audit.__main__ import audit_run  # pylint: disable=g-import-not-at-top
  from jax_dora.runtime import run_training  # pylint: disable=g-import-not-at-top

  table: dict[str, dict] = {}
  with tempfile.TemporaryDirectory() as tmp:
    for setting in args.settings.split(","):
      out = os.path.join(tmp, setting)
      cfg = setting_config(setting, args.steps, args.seed, out)
      summary = run_training(cfg)
      report = audit_run(out, measure_separation=True)
      sep = report["separation"]
      neighbours = [sep[k]["min"] for k in ("previous", "next") if sep[k]["n"]]
      row = {"claimed": sep["claimed"], "previous": sep["previous"], "next": sep["next"],
             "margin": (min(neighbours) / max(sep["claimed"]["max"], 1e-12)) if neighbours
             else float("nan"),
             "tolerance": report["label_tolerance"],
             "online_violations": summary["audit"]["violations"],
             "offline_violations": report["violations"]}
      table[setting] = row
      print(f"{setting}: {json.dumps(row)}", flush=True)
  print("\n| setting | claimed median / max | adjacent min / p10 / median | margin | tolerance |"
        " right labels flagged | off-by-one labels flagged |")
  print("|---|---|---|---|---|---|---|")
  for setting, row in table.items():
    c = row["claimed"]
    adj = [row[k] for k in ("previous", "next") if row[k]["n"]]
    lo = min(a["min"] for a in adj) if adj else float("nan")
    p10 = min(a["p10"] for a in adj) if adj else float("nan")
    med = min(a["median"] for a in adj) if adj else float("nan")
    caught = sum(a["flagged"] * a["n"] for a in adj) / max(sum(a["n"] for a in adj), 1)
    print(f"| {setting} | {c['median']:.2g} / {c['max']:.2g} | {lo:.2g} / {p10:.2g} / {med:.2g}"
          f" | {row['margin']:.3g}x | {row['tolerance']:g} | {c['flagged']:.1%} | {caught:.1%} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(table, f, indent=1)
  return table


if __name__ == "__main__":
  main()
