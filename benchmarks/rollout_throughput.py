"""Rollout throughput: slot scaling, continuous vs static batching, and the
long-context engine (attention over live lengths, group prefix sharing,
multi-version decode cost).

Measurements on small models (CPU-friendly), each printed side by side:

1. Tokens/s of the continuous-batching :class:`RolloutDriver` for
   ``slots = 1, 2, 4, ..., N`` (fixed-length requests): how well one decode
   step amortises across slots.
2. A long-tailed workload (per-request ``max_new_tokens`` drawn from the same
   truncated power law the tasks use), run side by side on one engine by the
   continuous driver and by :func:`static_generate` (whole batch prefilled,
   decoded in lockstep until its longest member ends). The ratio is the
   speed-up continuous batching buys on exactly the tail that stalls
   synchronous RL.

3. ``decode_len``: decode tokens/s at a fixed generated length for
   ``max_seq_len`` 512, 2048, 8192, the old engine (``decode_attention=
   "dense"``: every step scores the whole cache) against the new one
   (``"blocked"``: only blocks below the longest live row). The new engine's
   8192 / 512 ratio is the claim: cost follows what was generated.
4. ``prefix``: prefill tokens/s of GRPO groups (G members share one prompt of
   256+ tokens) with and without ``share_prompt_prefill``; prints the
   requested / computed token ratio (about G) and the wall-time ratio.
5. ``versions``: decode step time with 1, 2, 4 live versions (slots pinned
   round-robin), old engine (whole-row gathers) and new.

EOS is ignored so lengths follow the workload rather than a random policy's
EOS rate. Usage::

  python benchmarks/rollout_throughput.py            # a few minutes on a 2-core CPU
  python benchmarks/rollout_throughput.py --quick
  python benchmarks/rollout_throughput.py --sections=decode_len,prefix,versions
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
from static_batch import StaticStats, static_generate  # pylint: disable=wrong-import-position

from jax_dora.model import CharTokenizer, ModelConfig, init_params  # pylint: disable=wrong-import-position
from jax_dora.rollout import api  # pylint: disable=wrong-import-position
from jax_dora.rollout.driver import RolloutDriver  # pylint: disable=wrong-import-position
from jax_dora.rollout.engine import DoraEngine, MultiVersionParams  # pylint: disable=wrong-import-position
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


ENGINE_VARIANTS = (("old (dense)", "dense"), ("new (blocked)", "blocked"))


def _long_cfg(max_seq_len: int) -> ModelConfig:
  return ModelConfig(vocab_size=TOK.vocab_size, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                     d_ff=256, max_seq_len=max_seq_len)


def _filled_engine(cfg: ModelConfig, attention: str, slots: int, prompt_len: int, versions: int,
                   seed: int = 0):
  """An engine with every slot prefilled (``prompt_len`` tokens), slots pinned
  round-robin to ``versions`` distinct param sets; returns (engine, mv, state)."""
  engine = DoraEngine(cfg, TOK, num_slots=slots, max_prefill_length=prompt_len, temperature=1.0,
                      seed=seed, decode_attention=attention)
  params = {v: engine.place_params(init_params(cfg, jax.random.PRNGKey(seed + v)))
            for v in range(1, versions + 1)}
  rng = np.random.default_rng(seed)
  state = engine.init_decode_state()
  for v, p in params.items():
    rows = list(range(v - 1, slots, versions))
    ctxs = [rng.integers(3, TOK.vocab_size, size=prompt_len).astype(np.int32) for _ in rows]
    state, _, _ = engine.prefill_insert_batch_async(p, v, ctxs, rows, state)
  return engine, MultiVersionParams(params, tuple(params)), state


def _time_decode(engine, mv, state, steps: int) -> tuple[float, object]:
  """Seconds for ``steps`` generate calls (after one warm call).

  Each call gets the host-side ``DecodeHint`` the driver would pass (read
  once, then advanced a step at a time), so no step waits for the previous
  one, as in a server; every length bucket the loop meets is compiled first.
  """
  engine.warmup_decode(max_versions=len(mv.live))
  hint = engine.decode_hint(state, mv.live)
  state, res = engine.generate(mv, state, hint)
  jax.block_until_ready(res.data)
  t0 = time.perf_counter()
  for i in range(steps):
    state, res = engine.generate(mv, state, hint.advanced(i + 1))
  jax.block_until_ready(res.data)
  assert not bool(np.asarray(res.hint_violated))
  return time.perf_counter() - t0, state


def bench_decode_len(quick: bool) -> dict[int, dict[str, float]]:
  """Decode tokens/s at a fixed generated length vs max_seq_len, old and new."""
  slots, prompt_len, gen = 8, 64, (96 if quick else 192)
  lengths = (512, 2048, 8192)
  print(f"\n== decode tokens/s at {gen} generated tokens after a {prompt_len}-token prompt, "
        f"{slots} slots, d=128 L=4 ==")
  print(f"{'max_seq_len':>11} " + " ".join(f"{name:>15}" for name, _ in ENGINE_VARIANTS)
        + f" {'new/old':>8}")
  out = {}
  for s_len in lengths:
    row = {}
    for name, attention in ENGINE_VARIANTS:
      engine, mv, state = _filled_engine(_long_cfg(s_len), attention, slots, prompt_len, 1)
      wall, _ = _time_decode(engine, mv, state, gen)
      row[attention] = slots * gen / wall
    out[s_len] = row
    print(f"{s_len:>11} " + " ".join(f"{row[a]:>15.1f}" for _, a in ENGINE_VARIANTS)
          + f" {row['blocked'] / row['dense']:>7.2f}x", flush=True)
  for attention in ("dense", "blocked"):
    print(f"{attention}: tokens/s at max_seq_len 8192 / 512 = "
          f"{out[8192][attention] / out[512][attention]:.2f}", flush=True)
  return out


def bench_prefix(quick: bool) -> dict[str, float]:
  """Prefill of GRPO groups with and without prompt sharing."""
  group, groups, prompt_len = 8, (2 if quick else 4), 256
  slots = group * groups
  cfg = _long_cfg(1024)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, TOK.vocab_size, size=prompt_len).astype(np.int32) for _ in range(groups)]
  contexts = [p for p in prompts for _ in range(group)]
  print(f"\n== prefill of {groups} groups x G={group} members, {prompt_len}-token prompts ==")
  out = {}
  for share in (False, True):
    engine = DoraEngine(cfg, TOK, num_slots=slots, max_prefill_length=prompt_len, temperature=1.0,
                        share_prompt_prefill=share, prefill_batch_tokens=slots * prompt_len)
    params = engine.place_params(init_params(cfg, jax.random.PRNGKey(0)))
    walls = []
    for r in range(4):  # the first round compiles
      state = engine.init_decode_state()
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      state, firsts, work = engine.prefill_insert_batch_async(
          params, 1, contexts, list(range(slots)), state)
      jax.block_until_ready((state, firsts[-1][0]))
      if r:
        walls.append(time.perf_counter() - t0)
    wall = float(np.median(walls))
    out[share] = (work, wall)
    print(f"share_prompt_prefill={share!s:<5}: requested {work.requested_tokens} tokens, computed "
          f"{work.computed_tokens}, {wall * 1e3:.1f} ms = {work.requested_tokens / wall:.0f} "
          f"prompt tok/s", flush=True)
  (w0, t_off), (w1, t_on) = out[False], out[True]
  print(f"prompt prefill work cut by {w0.computed_tokens / w1.computed_tokens:.1f}x "
        f"(G = {group}); prefill wall time {t_off / t_on:.1f}x faster", flush=True)
  return {"work_ratio": w0.computed_tokens / w1.computed_tokens, "time_ratio": t_off / t_on}


def bench_versions(quick: bool) -> dict[str, dict[int, float]]:
  """Decode step time with 1, 2, 4 live versions."""
  slots, prompt_len, steps = 16, 64, (32 if quick else 64)
  cfg = _long_cfg(2048)
  print(f"\n== decode step time vs live versions, {slots} slots, max_seq_len {cfg.max_seq_len} ==")
  print(f"{'versions':>8} " + " ".join(f"{name + ' ms':>18}" for name, _ in ENGINE_VARIANTS))
  out = {a: {} for _, a in ENGINE_VARIANTS}
  for k in (1, 2, 4):
    for _, attention in ENGINE_VARIANTS:
      engine, mv, state = _filled_engine(cfg, attention, slots, prompt_len, k)
      wall, _ = _time_decode(engine, mv, state, steps)
      out[attention][k] = wall / steps * 1e3
    print(f"{k:>8} " + " ".join(f"{out[a][k]:>18.2f}" for _, a in ENGINE_VARIANTS), flush=True)
  for _, attention in ENGINE_VARIANTS:
    print(f"{attention}: 4 versions / 1 version step time = "
          f"{out[attention][4] / out[attention][1]:.2f}x")
  return out


SECTIONS = ("slots", "tail", "decode_len", "prefix", "versions")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="smaller sweep and workload (~1 min)")
  ap.add_argument("--max-slots", type=int, default=None)
  ap.add_argument("--tail-requests", type=int, default=None)
  ap.add_argument("--alpha", type=float, default=1.1, help="power-law exponent of lengths")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--rounds", type=int, default=None, help="alternating timing rounds")
  ap.add_argument("--sections", default=",".join(SECTIONS),
                  help=f"comma-separated subset of {SECTIONS}")
  args = ap.parse_args()
  sections = [x for x in args.sections.split(",") if x]
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    ap.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
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

    if "slots" in sections:
      _bench_slots(args, cfg, rng, snap_dir, max_slots)
    if "tail" in sections:
      _bench_tail(args, cfg, rng, snap_dir, max_slots, n_tail, max_len)
  if "decode_len" in sections:
    bench_decode_len(args.quick)
  if "prefix" in sections:
    bench_prefix(args.quick)
  if "versions" in sections:
    bench_versions(args.quick)


def _bench_slots(args, cfg, rng, snap_dir, max_slots) -> None:
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



def _bench_tail(args, cfg, rng, snap_dir, max_slots, n_tail, max_len) -> None:
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
