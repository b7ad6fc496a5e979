"""Unrolled vs scanned layers: compile time and step time of the programs a run compiles.

Usage::

  python benchmarks/scan_layers.py                      # tiny and deep shapes, both layouts
  python benchmarks/scan_layers.py --shapes tiny,deep,deep28 --parts engine --rounds 4 --steps 8
  python benchmarks/scan_layers.py --shapes tiny,deep,deep28 --parts learner --rounds 2 --steps 4

Every program of a run unrolls ``n_layers`` blocks; scanning over them
(``nn.scan`` over ``Block``, params stacked on a ``layers`` axis) compiles
one block instead. For each shape (``tiny``: ``configs/tiny.py``'s model;
``deep``: d_model 256, 16 layers; ``deep28``: the same at the 7B recipe's
28 layers) and each layout this measures, in one process on this machine's
CPU devices:

* the learner's train step (``configs/tiny.py``'s learner on a 4-device data
  mesh, its largest row length for ``tiny``, 8 rows x 256 for the deep ones),
* the engine's single-version decode program (16 slots, one length bucket)
  and one batched-prefill program (its largest row bucket at 32 tokens),

each as trace+lower seconds, XLA compile seconds and the median step of
timed calls after a warm one. Rounds alternate the layouts, so drift in the
machine's load hits both; the table reports each number's median over
rounds. The engine is scanned with its own switch (``DoraEngine(...,
scan_layers=True)``); the learner has none, so
its scanned variant is measured with the model and init swapped for
``Transformer(..., scan_layers=True)``'s here (``scanned_learner``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from configs import tiny  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.learner import train_state  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.learner.mesh import make_mesh  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.learner.train_state import Learner  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.model import CharTokenizer, ModelConfig, Transformer, init_key, init_params  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.rollout.engine import DecodeHint, DoraEngine, MultiVersionParams  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

TOK = CharTokenizer()
SHAPES = {
    # name: (model overrides, learner rows, learner length, decode bound, max_seq_len)
    "tiny": (dict(), 64, 96, 96, 96),
    "deep": (dict(d_model=256, n_layers=16, n_heads=8, n_kv_heads=4, d_ff=1024), 8, 256, 256, 512),
    # The 7B pod recipe's layer count at the deep shape's width.
    "deep28": (dict(d_model=256, n_layers=28, n_heads=8, n_kv_heads=4, d_ff=1024), 8, 256, 256, 512),
}


def model_config(shape: str) -> ModelConfig:
  overrides, *_, max_len = SHAPES[shape]
  c = tiny.get_config().model
  c.max_seq_len = max_len
  for k, v in overrides.items():
    setattr(c, k, v)
  return ModelConfig.from_config_dict(c, vocab_size=TOK.vocab_size)


@functools.cache
def _scanned_boxed_init(cfg: ModelConfig):
  one = jnp.zeros((1, 1), jnp.int32)
  return jax.jit(lambda rng: Transformer(cfg, scan_layers=True).init(rng, one, one)["params"])


@contextlib.contextmanager
def scanned_learner():
  """While building a Learner: its model, init and param layout are the scanned ones."""
  saved = train_state.Transformer, train_state.boxed_init, train_state.abstract_boxed_params
  train_state.Transformer = functools.partial(Transformer, scan_layers=True)
  train_state.boxed_init = _scanned_boxed_init
  train_state.abstract_boxed_params = lambda cfg: jax.eval_shape(
      _scanned_boxed_init(cfg), jax.eval_shape(init_key, 0))
  try:
    yield
  finally:
    train_state.Transformer, train_state.boxed_init, train_state.abstract_boxed_params = saved


def _timed(fn, *args, **kw):
  t0 = time.perf_counter()
  out = fn(*args, **kw)
  return out, time.perf_counter() - t0


def _median_step(call, steps: int) -> float:
  call()  # warm: the first call after an AOT compile still dispatches once
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def measure_learner(cfg: ModelConfig, scan: bool, rows: int, length: int,
                    steps: int) -> dict[str, float]:
  lc = tiny.get_config().learner
  mesh = make_mesh(jax.devices()[:4], data=4)
  with scanned_learner() if scan else contextlib.nullcontext():
    learner = Learner(cfg, lc, mesh, seed=0)
  batch = learner.batch_template(rows, length)
  rng = np.random.default_rng(0)
  batch["inputs"] = rng.integers(3, cfg.vocab_size, batch["inputs"].shape).astype(np.int32)
  batch["targets"] = rng.integers(3, cfg.vocab_size, batch["targets"].shape).astype(np.int32)
  batch["positions"] = np.broadcast_to(np.arange(batch["positions"].shape[1], dtype=np.int32),
                                       batch["positions"].shape).copy()
  batch["mask"] = np.ones_like(batch["mask"])
  batch["advantages"] = rng.standard_normal(batch["advantages"].shape).astype(np.float32)
  batch["behaviour_logprobs"] = -rng.random(batch["behaviour_logprobs"].shape).astype(np.float32)
  shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=learner.batch_sharding)
            for k, v in batch.items()}
  lowered, lower_s = _timed(learner._step_fn.lower, learner.state, shapes)  # pylint: disable=protected-access
  _, compile_s = _timed(lowered.compile)
  step_s = _median_step(lambda: learner.train_step(batch), steps)
  return {"lower_s": lower_s, "compile_s": compile_s, "step_s": step_s}


def measure_engine(cfg: ModelConfig, scan: bool, bound: int, steps: int) -> dict[str, float]:
  engine = DoraEngine(cfg, TOK, num_slots=16, max_prefill_length=32, devices=jax.devices()[4:5],
                      temperature=1.0, length_buckets=(bound,), scan_layers=scan)
  params = engine.place_params(init_params(cfg, jax.random.PRNGKey(0)))
  state = engine.init_decode_state()
  out = {}
  # Prefill: the largest row bucket at the 32-token length bucket.
  t = engine.buckets.prefill_length(32)
  u = engine.buckets.prefill_rows(t)[-1]
  lowered, out["prefill_lower_s"] = _timed(engine.programs.lower_prefill, u, t)
  _, out["prefill_compile_s"] = _timed(lowered.compile)
  rng = np.random.default_rng(0)
  contexts = [rng.integers(3, cfg.vocab_size, 24).astype(np.int32) for _ in range(16)]

  def prefill():
    nonlocal state
    state, firsts, _ = engine.prefill_insert_batch_async(params, 0, contexts, list(range(16)), state)
    return firsts[-1][0]

  out["prefill_step_s"] = _median_step(prefill, steps)
  # Decode: the single-version program at ``bound``.
  lowered, out["decode_lower_s"] = _timed(engine.programs.lower_decode, bound)
  _, out["decode_compile_s"] = _timed(lowered.compile)
  one = MultiVersionParams.single(0, params)
  hint = DecodeHint(max_position=bound, version_rows={0: 16})

  def decode():
    nonlocal state
    state = engine.init_decode_state() if int(state.positions.max()) >= bound - 1 else state
    state, res = engine.generate(one, state, hint)
    return res.data

  prefill()
  out["decode_step_s"] = _median_step(decode, steps * 4)
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shapes", default="tiny,deep")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--parts", default="learner,engine")
  ap.add_argument("--json", default="")
  args = ap.parse_args(argv)
  results: dict[str, dict[str, dict[str, list[float]]]] = {}
  for shape in args.shapes.split(","):
    _, rows, length, bound, _ = SHAPES[shape]
    for r in range(args.rounds):
      for scan in ((False, True) if r % 2 == 0 else (True, False)):
        layout = "scanned" if scan else "unrolled"
        cfg = model_config(shape)
        got = {}
        if "learner" in args.parts:
          got.update({f"train_{k}": v
                      for k, v in measure_learner(cfg, scan, rows, length, args.steps).items()})
        if "engine" in args.parts:
          got.update(measure_engine(cfg, scan, bound, args.steps))
        print(f"{shape} round {r} {layout}: " + ", ".join(f"{k} {v:.4f}" for k, v in got.items()),
              flush=True)
        slot = results.setdefault(shape, {}).setdefault(layout, {})
        for k, v in got.items():
          slot.setdefault(k, []).append(v)
  print(f"\n{'shape':6} {'measure':24} {'unrolled':>10} {'scanned':>10} {'scan/unroll':>12}")
  for shape, by_layout in results.items():
    for k in by_layout["unrolled"]:
      a = statistics.median(by_layout["unrolled"][k])
      b = statistics.median(by_layout["scanned"][k])
      print(f"{shape:6} {k:24} {a:10.4f} {b:10.4f} {b / a:12.2f}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
