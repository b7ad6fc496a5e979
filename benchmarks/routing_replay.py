"""Learner-vs-rollout mismatch of an MoE policy: routing recompute vs replay vs GSPO.

Usage::

  python benchmarks/routing_replay.py              # 12 runs of 12 steps, ~8 min on 2 CPU cores
  python benchmarks/routing_replay.py --steps 3    # a smoke run

Trains the tiny MoE policy (``configs/tiny.py`` with 8 experts of width 32,
top-2, in every layer) from one seed, in float32 and in bfloat16
activations, three ways:

* ``recompute``: GRPO, the learner routes by its own router's top-k;
* ``replay``: GRPO, ``learner.moe_routing=replay`` (the rollout's recorded
  experts, weighed by the live softmax);
* ``gspo``: GSPO's sequence-level ratio, routing recomputed (the other
  published remedy for MoE RL instability);

each in ``sync`` (every trained token sampled by the learner's current
version: what differs is the two programs, KV-cache decode vs the
full-sequence forward) and in ``dora_pace`` (tokens of older versions: the
policy's change since adds to it). It prints, averaged over the steps, side
by side: the k3 estimate of KL(behaviour || learner) on trained tokens
(``train/mismatch/kl_k3``; ``_stale_gt0`` for dora_pace's), the share of
recorded rollout routes the learner's own router picks differently at those
tokens (``train/moe/route_mismatch_stale0`` / ``_stale_gt0``, measured in
every arm), the importance-weight spread (``is_weight_max``), the clip
fraction and the mean train reward.

Prediction (written before the run): float32 on CPU, the two programs
agree to ~1e-6, so sync's routes almost never differ and its kl_k3 is
~1e-9 in every arm. In bfloat16, rounding flips near-tied routes: a few
percent of sync's routes differ and recompute's kl_k3 is orders of magnitude
above float32's; replay removes the routing part (attention and expert
arithmetic still differ), so its kl_k3 falls several fold; gspo changes the
update, not the mismatch. Under dora_pace the policy's change dominates both
figures (several percent of routes move with the policy in float32 too), and
replay, which pins the routes, should cut the stale tokens' kl as well.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jax_dora.config import base_config  # noqa: E402  pylint: disable=wrong-import-position

ARMS = {
    "recompute": {"learner.moe_routing": "recompute", "learner.loss": "grpo"},
    "replay": {"learner.moe_routing": "replay", "learner.loss": "grpo"},
    "gspo": {"learner.moe_routing": "recompute", "learner.loss": "gspo"},
}
# mode -> (its kl column, its route column): sync trains current-version tokens only,
# dora_pace (almost) only older versions' tokens.
MODES = {
    "sync": ("train/mismatch/kl_k3_stale0", "train/moe/route_mismatch_stale0"),
    "dora_pace": ("train/mismatch/kl_k3_stale_gt0", "train/moe/route_mismatch_stale_gt0"),
}
EXTRA = ("train/is_weight_max", "train/clip_frac", "reward_mean")


def arm_config(arm: str, mode: str, dtype: str, steps: int, seed: int, out: str):
  """The tiny MoE run of one arm."""
  c = base_config()
  c.mode = mode
  c.seed = seed
  c.total_steps = steps
  c.output_dir = out
  c.progress_bar = False
  c.precompile = False
  c.eval.num_prompts = 0
  c.eval.at_start = False
  c.model.dtype = dtype
  c.model.num_experts = 8
  c.model.num_experts_per_tok = 2
  c.model.moe_d_ff = 32
  c.learner.moe_aux_loss_coef = 0.01
  for key, value in ARMS[arm].items():
    block, name = key.split(".")
    setattr(getattr(c, block), name, value)
  return c


def _means(metrics_path: str, columns) -> dict[str, float]:
  with open(metrics_path) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  steps = [r for r in recs if "train/mismatch/kl_k3" in r]
  out = {}
  for col in columns:
    vals = [r[col] for r in steps if r.get(col) is not None]
    out[col] = sum(vals) / len(vals) if vals else float("nan")
  out["steps"] = len(steps)
  out["stale_token_frac"] = sum(r["train/stale_token_frac"] for r in steps) / max(len(steps), 1)
  return out


def main(argv=None) -> dict[str, dict[str, float]]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--arms", default=",".join(ARMS))
  ap.add_argument("--modes", default=",".join(MODES))
  ap.add_argument("--json", default="", help="also write the table here")
  args = ap.parse_args(argv)
  from jax_dora.runtime import run_training  # pylint: disable=g-import-not-at-top

  table: dict[str, dict[str, float]] = {}
  with tempfile.TemporaryDirectory() as tmp:
    for dtype in args.dtypes.split(","):
      for mode in args.modes.split(","):
        for arm in args.arms.split(","):
          name = f"{dtype}/{mode}/{arm}"
          out = os.path.join(tmp, name.replace("/", "-"))
          summary = run_training(arm_config(arm, mode, dtype, args.steps, args.seed, out))
          kl, routes = MODES[mode]
          row = _means(os.path.join(out, "metrics.jsonl"), (kl, routes) + EXTRA)
          row["kl_k3"], row["route_mismatch"] = row.pop(kl), row.pop(routes)
          row["integrity_violations"] = len(summary["integrity_violations"])
          table[name] = row
          print(f"{name}: {row}", flush=True)
  cols = ("kl_k3", "route_mismatch", "stale_token_frac") + EXTRA
  print("\n| dtype / mode / arm | " + " | ".join(c.split("/")[-1] for c in cols) + " | audit |")
  print("|---|" + "---|" * (len(cols) + 1))
  for name, row in table.items():
    cells = [f"{row[c]:.3g}" for c in cols]
    audit = "clean" if row["integrity_violations"] == 0 else f"{row['integrity_violations']} violations"
    print(f"| {name} | " + " | ".join(cells) + f" | {audit} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(table, f, indent=1)
  return table


if __name__ == "__main__":
  main()
