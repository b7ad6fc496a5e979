"""The MoE block's grouped matmul (``jax.lax.ragged_dot``) against its floor and the dense alternative.

Usage::

  python benchmarks/moe_grouped_matmul.py            # Qwen3-30B-A3B's expert shape, bf16
  python benchmarks/moe_grouped_matmul.py --small    # a CPU-sized shape, float32

Times, side by side in one run, on ``N`` tokens routed to ``k`` of ``E``
experts (``[N*k, D]`` rows sorted by expert, equal group sizes):

* ``ragged_dot``: what ``jax_dora.model.moe`` runs, ``[N*k, D] x [E, D, F]``;
* ``floor``: one dense ``[N*k, D] x [D, F]`` matmul, the same FLOPs a grouped
  kernel must do (its time is what ``ragged_dot`` should approach);
* ``all experts``: every token through every expert (``[N, D] x [E, D, F]``),
  the FLOPs of one-hot dispatch without capacity (``E / k`` times the floor's).

Prediction: on TPU and GPU (grouped kernels) ``ragged_dot`` within ~2x of
the floor; on XLA:CPU, which expands it into one masked copy of the rows per
expert and a dense product (DESIGN.md, "Mixture of experts"), about ``E``
times the floor, i.e. ``k`` times the all-experts product. The printed
ratios are what to compare with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position


def _time(fn, *args, iters: int) -> float:
  """Median seconds of ``fn(*args)`` after one compile-and-run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return sorted(times)[len(times) // 2]


def main(argv=None) -> dict[str, float]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--d_model", type=int, default=2048)
  ap.add_argument("--d_ff", type=int, default=768)
  ap.add_argument("--experts", type=int, default=128)
  ap.add_argument("--top_k", type=int, default=8)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--small", action="store_true", help="1,024 tokens, D 256, F 128, 16 experts,"
                  " top-4, float32 (a CPU-sized run)")
  ap.add_argument("--json", default="")
  a = ap.parse_args(argv)
  if a.small:
    a.tokens, a.d_model, a.d_ff, a.experts, a.top_k, a.dtype = 1024, 256, 128, 16, 4, "float32"
  n, d, f, e, k = a.tokens, a.d_model, a.d_ff, a.experts, a.top_k
  dtype = jnp.dtype(a.dtype)
  keys = jax.random.split(jax.random.key(0), 3)
  rows = jax.random.normal(keys[0], (n * k, d), dtype)
  tokens = rows[:n]
  w = jax.random.normal(keys[1], (e, d, f), dtype) / d ** 0.5
  sizes = jnp.full((e,), n * k // e, jnp.int32).at[-1].add(n * k - e * (n * k // e))
  ragged = jax.jit(jax.lax.ragged_dot)
  floor = jax.jit(lambda x, w0: x @ w0)
  every = jax.jit(lambda x, w: jnp.einsum("nd,edf->nef", x, w))
  t_ragged = _time(ragged, rows, w, sizes, iters=a.iters)
  t_floor = _time(floor, rows, w[0], iters=a.iters)
  t_every = _time(every, tokens, w, iters=a.iters)
  flops = 2 * n * k * d * f
  device = jax.devices()[0]
  print(f"{device.platform} ({device.device_kind}); {n} tokens -> top-{k} of {e} experts,"
        f" D {d}, F {f}, {a.dtype}; one projection")
  print(f"{'ragged_dot':<28} {t_ragged * 1e3:9.3f} ms  {flops / t_ragged / 1e12:7.2f} TFLOP/s"
        f"  {t_ragged / t_floor:6.1f}x the floor")
  print(f"{'floor (one dense matmul)':<28} {t_floor * 1e3:9.3f} ms  {flops / t_floor / 1e12:7.2f}"
        " TFLOP/s")
  print(f"{'all experts (E/k x FLOPs)':<28} {t_every * 1e3:9.3f} ms"
        f"  {t_every / t_floor:6.1f}x the floor (E/k = {e / k:.0f})")
  out = {"ragged_s": t_ragged, "floor_s": t_floor, "all_experts_s": t_every,
         "ragged_over_floor": t_ragged / t_floor, "experts": e, "top_k": k,
         "platform": device.platform}
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(out, fh, indent=1)
  return out


if __name__ == "__main__":
  main()
