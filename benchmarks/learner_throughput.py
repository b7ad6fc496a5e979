"""Learner step time on long-tailed batches: length-grouped micro-batches vs the fused step.

Usage::

  python benchmarks/learner_throughput.py            # the long-context workload's batches
  python benchmarks/learner_throughput.py --steps 2 --micro 8

A batch of long-tailed reasoning answers is padded to the bucket of its
longest row, so every row pays for the longest answer's positions (and the
learner's attention is quadratic in them). With
``learner.group_micro_batches_by_length`` the rows are sorted by length and
each micro-batch is padded to its own bucket. This script draws real
batches from ``configs/long_context.py``'s task (prompts and answers
tokenised by its tokenizer, answer lengths from its power law), trains the
same batches with both learners side by side in one run (after each has
compiled every bucket), checks they reach the same loss, and prints the
step times, the positions each computed, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from configs import long_context  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.data.pipeline import make_mixture  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.learner.batching import bucket_length, make_batch, parse_buckets  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.learner.losses import compute_advantages  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.learner.mesh import make_mesh  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.learner.train_state import Learner  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.policy import resolve_policy  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.types import TokenSpan, Trajectory  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def draw_batches(cfg, tokenizer, steps: int, seed: int) -> list[dict[str, np.ndarray]]:
  """``steps`` GRPO batches of the workload: task prompts, reference answers as completions."""
  mixture = make_mixture(cfg)
  rng = np.random.default_rng(seed)
  lc, max_len = cfg.learner, cfg.model.max_seq_len
  buckets = parse_buckets(str(lc.seq_len_buckets), max_len)
  batches = []
  for step in range(steps):
    trajs = []
    for g in range(lc.groups_per_step):
      prompt = mixture.make_prompt(step * lc.groups_per_step + g, rng)
      ids = tokenizer.encode_prompt(prompt.text)
      for member in range(lc.group_size):
        # Members of a group answer with different lengths, as sampled ones do.
        answer = mixture.make_prompt(10_000 + member, rng).answer
        completion = tokenizer.encode_ids(answer)[:max_len - len(ids)]
        trajs.append(Trajectory(
            sample_id=prompt.sample_id, member=member, prompt=prompt, prompt_tokens=ids,
            completion_tokens=completion,
            behaviour_logprobs=-rng.random(len(completion)).astype(np.float32),
            spans=[TokenSpan(0, len(completion), 0)], finish_reason="length", reward=0.0))
    adv = compute_advantages("grpo", rng.random(len(trajs)), lc.group_size)
    batches.append(make_batch(trajs, adv, bucket_length(trajs, buckets)))
  return batches


def time_steps(learner: Learner, batches) -> tuple[list[float], list[dict[str, float]]]:
  times, metrics = [], []
  for batch in batches:
    t0 = time.perf_counter()
    metrics.append(learner.train_step(batch))
    times.append(time.perf_counter() - t0)
  return times, metrics


def main(argv=None) -> dict[str, float]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--devices", type=int, default=4,
                  help="learner devices (data parallel), as configs/long_context.py's learner")
  args = ap.parse_args(argv)

  cfg = long_context.get_config()
  policy = resolve_policy(cfg)
  batches = draw_batches(cfg, policy.tokenizer, args.steps, args.seed)
  mesh = make_mesh(jax.devices()[:args.devices])
  buckets = parse_buckets(str(cfg.learner.seq_len_buckets), cfg.model.max_seq_len)
  rows = cfg.learner.groups_per_step * cfg.learner.group_size
  results = {}
  for name, overrides in (("fused", {}),
                          ("grouped", dict(micro_batch_size=args.micro,
                                           group_micro_batches_by_length=True))):
    lc = cfg.learner.copy_and_resolve_references()
    lc.update(overrides)
    learner = Learner(policy.model_cfg, lc, mesh, seed=args.seed)
    t0 = time.perf_counter()
    learner.warmup(rows, buckets)
    compile_s = time.perf_counter() - t0
    times, metrics = time_steps(learner, batches)
    results[name] = dict(step_s=float(np.mean(times)), compile_s=compile_s,
                         positions=float(np.mean([m["positions_computed"] for m in metrics])),
                         loss=[m["loss"] for m in metrics])
    print(f"{name:>8}: {results[name]['step_s']:.2f} s/step (warmup {compile_s:.0f} s),"
          f" {results[name]['positions']:.0f} positions/step", flush=True)
    del learner
  lengths = [int(b["mask"].sum(1).max()) for b in batches]
  np.testing.assert_allclose(results["grouped"]["loss"], results["fused"]["loss"], rtol=2e-3)
  speedup = results["fused"]["step_s"] / results["grouped"]["step_s"]
  work = results["fused"]["positions"] / results["grouped"]["positions"]
  print(f"longest answer per batch: {lengths}; {rows} rows, micro-batches of {args.micro}")
  print(f"grouped / fused: {speedup:.2f}x faster per step, {work:.2f}x fewer positions;"
        " same losses")
  return {"speedup": speedup, "work_ratio": work}


if __name__ == "__main__":
  main()
