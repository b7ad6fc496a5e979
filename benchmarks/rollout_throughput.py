"""Rollout throughput: slot scaling, and continuous vs static batching.

Two measurements on a tiny model (CPU-friendly):

1. Tokens/s of the continuous-batching :class:`RolloutDriver` for
   ``slots = 1, 2, 4, ..., N`` (fixed-length requests): how well one decode
   step amortises across slots.
2. A long-tailed workload (per-request ``max_new_tokens`` drawn from the same
   truncated power law the tasks use), run side by side on one engine by the
   continuous driver and by :func:`static_generate` (whole batch prefilled,
   decoded in lockstep until its longest member ends). The ratio is the
   speed-up continuous batching buys on exactly the tail that stalls
   synchronous RL.

EOS is ignored in both so lengths follow the workload rather than a random
policy's EOS rate. Usage::

  python benchmarks/rollout_throughput.py            # < 3 min on a 2-core CPU
  python benchmarks/rollout_throughput.py --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from jax_dora.model import CharTokenizer, ModelConfig, init_params  # pylint: disable=wrong-import-position
from jax_dora.rollout import api  # pylint: disable=wrong-import-position
from jax_dora.rollout.driver import RolloutDriver  # pylint: disable=wrong-import-position
from jax_dora.rollout.engine import DoraEngine  # pylint: disable=wrong-import-position
from static_batch import StaticStats, static_generate  # pylint: disable=wrong-import-position
from jax_dora.snapshots import SnapshotPublisher  # pylint: disable=wrong-import-position
from jax_dora.tasks import long_tail  # pylint: disable=wrong-import-position

TOK = CharTokenizer()


def _prompts(n: int, rng: np.random.Generator) -> list[np.ndarray]:
  out = []
  for _ in range(n):
    a, b = rng.integers(0, 1000, size=2)
    out.append(TOK.encode(f"{a}+{b}=", is_bos=True)[0])
  return out


def _run_driver(driver: RolloutDriver, prompts, budgets, tag: str) -> tuple[int, float]:
  """Submits everything at once; returns (generated tokens, wall seconds)."""
  done = threading.Semaphore(0)
  results = {}

  def cb_for(rid):
    def cb(item):
      if isinstance(item, (api.RolloutResult, api.RolloutError)):
        results[rid] = item
        done.release()
    return cb

  t0 = time.perf_counter()
  for i, (p, b) in enumerate(zip(prompts, budgets)):
    rid = f"{tag}{i}"
    driver.submit(api.RolloutRequest(rid, p, max_new_tokens=int(b)), cb_for(rid))
  for _ in prompts:
    done.acquire()
  wall = time.perf_counter() - t0
  bad = [r for r in results.values() if not isinstance(r, api.RolloutResult)]
  if bad:
    raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
  return sum(len(r.completion_tokens) for r in results.values()), wall


def _make(cfg: ModelConfig, slots: int, snap_dir: str) -> tuple[DoraEngine, RolloutDriver]:
  engine = DoraEngine(cfg, TOK, num_slots=slots, max_prefill_length=16, temperature=1.0, seed=slots)
  driver = RolloutDriver(engine, snap_dir, max_versions=2, name=f"bench{slots}", stop_on_eos=False)
  driver.load_version(1)
  return engine, driver


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="smaller sweep and workload (~1 min)")
  ap.add_argument("--max-slots", type=int, default=None)
  ap.add_argument("--tail-requests", type=int, default=None)
  ap.add_argument("--alpha", type=float, default=1.1, help="power-law exponent of lengths")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--rounds", type=int, default=None, help="alternating timing rounds")
  args = ap.parse_args()
  max_slots = args.max_slots or (8 if args.quick else 16)
  n_tail = args.tail_requests or (64 if args.quick else 256)
  args.rounds = args.rounds or (1 if args.quick else 3)
  max_len = 64

  cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=64, n_layers=2, n_heads=4, d_ff=128,
                    max_seq_len=16 + max_len)
  rng = np.random.default_rng(args.seed)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; model d={cfg.d_model} "
        f"L={cfg.n_layers} S={cfg.max_seq_len}", flush=True)

  with tempfile.TemporaryDirectory() as tmp:
    snap_dir = os.path.join(tmp, "snaps")
    with SnapshotPublisher(snap_dir, max_to_keep=2) as pub:
      pub.publish(1, init_params(cfg, jax.random.PRNGKey(args.seed)))

    # 1) Slot scaling with fixed-length requests.
    fixed_len = 48
    print(f"\n== continuous batching, fixed length {fixed_len} ==")
    print(f"{'slots':>6} {'tokens':>7} {'wall_s':>7} {'tok/s':>9} {'speedup':>8}")
    slots, base = 1, None
    while slots <= max_slots:
      _, driver = _make(cfg, slots, snap_dir)
      warm = _prompts(slots, rng)
      _run_driver(driver, warm, [4] * len(warm), "w")  # compile
      n_req = 4 * slots if args.quick else 8 * slots
      toks, wall = _run_driver(driver, _prompts(n_req, rng), [fixed_len] * n_req, "s")
      driver.stop()
      tps = toks / wall
      base = base or tps
      print(f"{slots:>6} {toks:>7} {wall:>7.2f} {tps:>9.1f} {tps / base:>7.2f}x", flush=True)
      slots *= 2

    # 2) Long-tailed workload: continuous vs static, same engine, same prompts.
    slots = max_slots
    engine, driver = _make(cfg, slots, snap_dir)
    budgets = [long_tail.sample_length(rng, max_len, args.alpha) for _ in range(n_tail)]
    prompts = _prompts(n_tail, rng)
    pct = np.percentile(budgets, [50, 90, 99])
    print(f"\n== long-tailed workload: {n_tail} requests, slots={slots}, lengths power law "
          f"alpha={args.alpha} max={max_len}: mean {np.mean(budgets):.1f}, p50 {pct[0]:.0f}, "
          f"p90 {pct[1]:.0f}, p99 {pct[2]:.0f} ==")
    _run_driver(driver, prompts[:slots], budgets[:slots], "w")  # compile both paths
    params = driver.store.params(1)
    static_generate(engine, params, prompts[:slots], 2, stop_on_eos=False)

    # Alternate the two schedulers a few times so machine noise hits both.
    c_runs, s_runs = [], []
    for r in range(args.rounds):
      steps0 = driver.steps
      c_toks, c_wall = _run_driver(driver, prompts, budgets, f"c{r}_")
      c_runs.append((c_wall, driver.steps - steps0))
      stats = StaticStats()
      t0 = time.perf_counter()
      res = static_generate(engine, params, prompts, budgets, stop_on_eos=False, stats=stats)
      s_runs.append((time.perf_counter() - t0, stats))
      s_toks = sum(len(r.tokens) for r in res)
      assert s_toks == c_toks == sum(budgets), (s_toks, c_toks, sum(budgets))
    driver.stop()
    c_wall, c_steps = sorted(c_runs)[len(c_runs) // 2]
    s_wall, stats = sorted(s_runs, key=lambda x: x[0])[len(s_runs) // 2]
    c_tps, s_tps = c_toks / c_wall, s_toks / s_wall
    print(f"continuous: {c_toks} tokens in {c_wall:.2f}s = {c_tps:.1f} tok/s "
          f"({c_steps} steps, slot utilisation {c_toks / max(1, c_steps * slots):.0%})")
    print(f"static:     {s_toks} tokens in {s_wall:.2f}s = {s_tps:.1f} tok/s "
          f"({stats.steps} steps, slot utilisation {stats.useful_tokens / max(1, stats.steps * slots):.0%})")
    print(f"continuous / static throughput ratio: {c_tps / s_tps:.2f}x "
          f"(median of {args.rounds} alternating rounds)", flush=True)


if __name__ == "__main__":
  main()
