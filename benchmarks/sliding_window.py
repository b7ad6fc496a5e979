"""Sliding-window (local) layers vs all-global layers: decode step time and KV-cache memory.

Usage::

  python benchmarks/sliding_window.py                    # 4k and 16k context, 3 interleaved rounds
  python benchmarks/sliding_window.py --small            # CI smoke: 512 context, 1 round

Gemma 2/3 make most layers local: Gemma 3 is five local layers (window 512
at 1B, 1024 above) per global one. The engine keeps one cache layout for
every layer (``[L, slots, Hkv, max_seq_len, D]``), so a local layer's
entries beyond its window are still allocated; what the window buys is the
decode read: the blocked kernel starts each row's chunks at
``position - window + 1`` and reads ``ceil((window - 1) / chunk)`` chunks
instead of the context's (``transformer._attend_cache_and_self``).

This measures, on this machine, the decode program the engine runs
(``Transformer.decode``: every layer, the LM head, the engine's default
chunk, the host's length bucket as the static bound) for a Gemma-3-1B-shaped
model cut to ``--layers`` blocks (d_model 1152, 4 query heads, 1 KV head of
256, d_ff 6912, Gemma 3's 5:1 local:global pattern, window 512), against
the same model with every layer global, with every slot at the context's
last position, and against the floor: the same model with every layer local
at window 1 (no cache read at all: the MLPs, projections and head, which the
window cannot shorten). Rounds alternate the three models so load drift hits
all; the table gives medians, and the attention share of each step (step
minus floor). Printed beside the times: the cache bytes allocated
(equal by design), the bytes a step reads (the prediction for the time
ratio where attention dominates), and what a ring buffer for local layers
would allocate instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from jax_dora.model import KVCache, ModelConfig, Transformer, init_params  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


KINDS = ("local", "global", "floor")


def gemma3_shape(layers: int, window: int, context: int, kind: str, small: bool) -> ModelConfig:
  """Gemma 3 1B's block (hidden 1152, 4 heads, 1 KV head of 256, GeGLU 6912), ``layers`` deep,
  layers 0-4 of every 6 local (``kind="local"``), all global (``"global"``) or all local at
  window 1 (``"floor"``); vocabulary cut to 8192 so the head does not hide the attention."""
  shape = dict(d_model=1152, n_heads=4, n_kv_heads=1, head_dim=256, d_ff=6912, vocab_size=8192)
  if small:
    shape = dict(d_model=64, n_heads=4, n_kv_heads=1, head_dim=16, d_ff=96, vocab_size=256)
  return ModelConfig(
      n_layers=layers, max_seq_len=context, mlp_activation="gelu_tanh", norm_scale_offset=1.0,
      post_norms=True, scale_embeddings=True, qk_norm=True, query_pre_attn_scalar=256.0,
      tie_embeddings=True, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
      sliding_window={"local": window, "global": 0, "floor": 1}[kind],
      local_layers={"local": tuple(i for i in range(layers) if (i + 1) % 6), "global": (),
                    "floor": tuple(range(layers))}[kind], **shape)


def measure(cfg: ModelConfig, slots: int, steps: int) -> dict:
  """Median seconds of the decode program with every slot at position ``max_seq_len - 1``."""
  params = init_params(cfg, jax.random.PRNGKey(0))
  s = cfg.max_seq_len
  cache = KVCache(
      k=jax.random.normal(jax.random.PRNGKey(1), (cfg.n_layers, slots, cfg.n_kv_heads, s,
                                                   cfg.head_dim), jnp.float32),
      v=jax.random.normal(jax.random.PRNGKey(2), (cfg.n_layers, slots, cfg.n_kv_heads, s,
                                                   cfg.head_dim), jnp.float32))
  model = Transformer(cfg)
  pos = np.full((slots, 1), s - 1, np.int32)
  tok = np.ones((slots, 1), np.int32)
  bound = s  # the host's length bucket for rows at the last position: the whole cache

  @jax.jit
  def step(params, tok, pos, cache):
    return model.apply({"params": params}, tok, pos, cache, None, bound, method=Transformer.decode)

  jax.block_until_ready(step(params, tok, pos, cache))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, tok, pos, cache))
    times.append(time.perf_counter() - t0)
  return {"step_s": statistics.median(times)}


def cache_bytes(cfg: ModelConfig, slots: int, context: int) -> dict:
  """Allocated, read per step, and a ring buffer's allocation (float32 K and V)."""
  per_entry = 2 * cfg.n_kv_heads * cfg.head_dim * 4 * slots
  window = cfg.sliding_window
  n_local = len(cfg.local_layers)
  n_global = cfg.n_layers - n_local
  # What a step reads is also what a cache holding only each local layer's window would
  # allocate: the context for global layers, the window for local ones.
  needed = per_entry * (n_global * context + n_local * min(window, context))
  return {"allocated": per_entry * cfg.n_layers * context, "read_per_step": needed,
          "ring_buffer": needed}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--contexts", default="4096,16384")
  p.add_argument("--layers", type=int, default=6)
  p.add_argument("--window", type=int, default=512)
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--small", action="store_true", help="CI smoke: tiny model, 512 context, 1 round")
  p.add_argument("--json", default="", help="write the results here")
  a = p.parse_args(argv)
  contexts = [int(c) for c in a.contexts.split(",")]
  if a.small:
    contexts, a.window, a.rounds, a.steps, a.slots = [512], 64, 1, 2, 2
  out: dict = {"machine": f"{os.cpu_count()} CPU cores, jax {jax.__version__}",
               "layers": a.layers, "window": a.window, "slots": a.slots, "contexts": {}}
  for context in contexts:
    runs: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(a.rounds):  # interleaved: each round measures all three
      for kind in KINDS:
        cfg = gemma3_shape(a.layers, a.window, context, kind, a.small)
        runs[kind].append(measure(cfg, a.slots, a.steps)["step_s"])
    row = {f"{k}_step_s": statistics.median(v) for k, v in runs.items()}
    row.update({f"{k}_rounds": v for k, v in runs.items()})
    row["local_bytes"] = cache_bytes(gemma3_shape(a.layers, a.window, context, "local", a.small),
                                     a.slots, context)
    row["global_bytes"] = cache_bytes(gemma3_shape(a.layers, a.window, context, "global", a.small),
                                      a.slots, context)
    row["time_ratio"] = row["local_step_s"] / row["global_step_s"]
    row["attention_ratio"] = ((row["local_step_s"] - row["floor_step_s"])
                              / max(row["global_step_s"] - row["floor_step_s"], 1e-9))
    row["read_ratio"] = row["local_bytes"]["read_per_step"] / row["global_bytes"]["read_per_step"]
    out["contexts"][context] = row
  n_local = len(gemma3_shape(a.layers, a.window, 16, "local", a.small).local_layers)
  print(f"{a.layers} layers ({n_local} local, window {a.window}), {a.slots} slots, float32 cache,"
        f" {out['machine']}")
  print("| context | decode step, 5:1 local | all global | floor (no cache read) | step ratio"
        " | attention ratio (step - floor) | KV read ratio (prediction) | KV allocated, both"
        " | a window-sized local cache would allocate |")
  print("|---|---|---|---|---|---|---|---|---|")
  for context, r in out["contexts"].items():
    mib = 2 ** 20
    print(f"| {context} | {r['local_step_s'] * 1e3:.1f} ms | {r['global_step_s'] * 1e3:.1f} ms"
          f" | {r['floor_step_s'] * 1e3:.1f} ms | {r['time_ratio']:.2f}"
          f" | {r['attention_ratio']:.2f} | {r['read_ratio']:.2f}"
          f" | {r['local_bytes']['allocated'] / mib:.0f} MiB"
          f" | {r['local_bytes']['ring_buffer'] / mib:.0f} MiB |")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
