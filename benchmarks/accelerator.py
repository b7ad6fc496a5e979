"""Accelerator benchmark (issue 23): every speed figure against a floor counted in the same run.

One run on whatever backend is present produces, for a Qwen2.5-shaped model
with random weights (``--shape 0.5b | 1.5b | 7b``):

* ``env``: the device's copy bandwidth and bf16 matmul rate, *measured here*
  (they are the denominators of every floor below), backend, device, versions.
* ``import``: ``import jax_dora.rollout.engine`` in a fresh interpreter:
  seconds, peak RSS, and whether TensorFlow came along.
* ``decode``: ``DoraEngine.generate`` ms/step and tok/s for every slot count
  in ``--slots`` and every live-version count in ``--versions`` (slots pinned
  round-robin to versions), and the K-version / 1-version step-time ratio.
* ``prefill``: batched prefill (``prefill_insert_batch_async``, prompt
  sharing off) prompt tok/s.
* ``learner``: ``Learner`` build (random init) and compile seconds, then
  ``train_step`` s/step, tok/s and MFU (64 rows x 1024 tokens, f32 params,
  bf16 activations, micro-batch 16, chunked log-probs, remat ``dots``).
* ``hf``: Hugging Face ``generate`` (torch, CUDA, bf16) on the same shape and
  work, where torch with CUDA imports; else "skipped (no CUDA torch)".

How the floors are counted (``decode_step_work``, ``prefill_work``,
``learner_step_flops``; ``tests/test_benchmarks.py`` checks them against
numbers worked out by hand). Every timed unit of work gets a pair
(bytes it must move through device memory, FLOPs it must do); its floor is
``max(bytes / measured copy bandwidth, FLOPs / measured bf16 matmul rate)``
(a roofline), summed over the units, and each figure is printed with that
floor and ``floor / measured`` ("of floor": 1.0 = at the roofline).

* A decode step reads every parameter once per live version (all of them
  except an untied embedding table, of which only the ``rows`` gathered rows
  are read; a tied table is read whole as the LM head) plus the live KV
  cache: for every active slot, ``position`` cached tokens x ``n_layers`` x
  2 (K and V) x ``n_kv_heads`` x ``head_dim`` x dtype bytes. Its FLOPs are
  ``2 * N * rows`` (``N`` = the weights that take part in a matmul: every
  layer's q/k/v/o and MLP matrices plus the ``d_model x vocab`` head) plus
  attention, ``4 * n_layers * n_heads * head_dim * (position + 1)`` per row
  (scores and values over the cache and the new token).
* A prefill call reads the parameters once and writes the prompt's KV
  entries; its FLOPs are ``2 * N_layers * tokens`` (no head: only each
  prompt's last position is sampled, ``2 * d_model * vocab`` per prompt) plus
  causal attention ``2 * n_layers * n_heads * head_dim * T^2`` per prompt of
  ``T`` tokens (``QK^T`` and ``AV``, 2 FLOPs a multiply-add, half the square).
* A learner step does ``6 * N * tokens`` (forward 2, backward 4) plus causal
  attention forward and backward, ``6 * n_layers * T^2 * n_heads * head_dim``
  per row of ``T`` tokens; its floor is FLOPs only, so "of floor" *is* the
  MFU. Recomputation (remat) is not counted: MFU counts the model's FLOPs.
* Building the learner writes its train state (params and Adam moments):
  those bytes over the bandwidth.

Peaks: copy bandwidth = (bytes read + bytes written) / time of a jitted
``x + 1`` over a large bf16 array; matmul rate = ``2 n^3`` / time of an
``n x n`` bf16 matmul with float32 accumulation; best of several, sizes
scaled down on CPU and under ``--small``.

Usage::

  python benchmarks/accelerator.py                     # 0.5B, every section
  python benchmarks/accelerator.py --shape 7b --sections env,decode,hf --json out.json
  python benchmarks/accelerator.py --small             # tiny shape on CPU, < 2 minutes
  python benchmarks/accelerator.py --profile /tmp/prof # + traces of one decode loop and one step

The script imports only what each section needs (no TensorFlow, no dataset
libraries), so it runs from a bare checkout with jax, flax, optax and (for
``hf``) torch and transformers. The ``hf`` section runs first, in a child
process, before JAX takes the GPU (JAX preallocates most of its memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SECTIONS = ("env", "import", "decode", "prefill", "learner", "hf")
PROFILE_STEPS = 8  # decode steps run under the profiler after the timed loop
HF_MARK = "HF_RESULT "


# --------------------------------------------------------------------- shapes
@dataclasses.dataclass(frozen=True)
class Shape:
  """The architecture fields the counts need (names as ``ModelConfig``'s)."""

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  tie_embeddings: bool
  qkv_bias: bool = True
  rope_theta: float = 1_000_000.0

  def model_config(self, max_seq_len: int, param_dtype: str, dtype: str) -> Any:
    from jax_dora.model import ModelConfig  # pylint: disable=g-import-not-at-top
    return ModelConfig(**dataclasses.asdict(self), max_seq_len=int(max_seq_len),
                       param_dtype=param_dtype, dtype=dtype)


SHAPES = {
    # Qwen2.5-0.5B / 1.5B / 7B (random weights).
    "0.5b": Shape(151936, 896, 24, 14, 2, 64, 4864, tie_embeddings=True),
    "1.5b": Shape(151936, 1536, 28, 12, 2, 128, 8960, tie_embeddings=True),
    "7b": Shape(152064, 3584, 28, 28, 4, 128, 18944, tie_embeddings=False),
}
# --small: the same structure (GQA, q/k/v biases, tied head) at CPU scale.
SMALL_SHAPE = Shape(1024, 64, 2, 4, 2, 16, 128, tie_embeddings=True)


# ------------------------------------------------------------------- counting
def layer_matmul_params(s: Shape) -> int:
  """Weights of one block that take part in a matmul: q, k, v, o and the SwiGLU MLP."""
  q = s.n_heads * s.head_dim
  kv = s.n_kv_heads * s.head_dim
  return s.d_model * q + 2 * s.d_model * kv + q * s.d_model + 3 * s.d_model * s.d_ff


def matmul_params(s: Shape) -> int:
  """``N`` of the FLOP counts: every block's matmul weights plus the ``d_model x vocab`` head."""
  return s.n_layers * layer_matmul_params(s) + s.d_model * s.vocab_size


def param_count(s: Shape) -> int:
  """All parameters: embedding (+ untied head), blocks with biases and norms, final norm."""
  bias = (s.n_heads + 2 * s.n_kv_heads) * s.head_dim if s.qkv_bias else 0
  block = layer_matmul_params(s) + bias + 2 * s.d_model
  head = 0 if s.tie_embeddings else s.d_model * s.vocab_size
  return s.vocab_size * s.d_model + head + s.n_layers * block + s.d_model


def param_read_bytes(s: Shape, rows: int, dtype_bytes: int) -> int:
  """Parameter bytes one forward pass over ``rows`` tokens must read.

  An untied embedding table is only gathered (``rows`` rows of it); a tied
  one is the LM head and is read whole.
  """
  if s.tie_embeddings:
    return param_count(s) * dtype_bytes
  table = s.vocab_size * s.d_model
  return (param_count(s) - table + min(rows, s.vocab_size) * s.d_model) * dtype_bytes


def kv_bytes_per_token(s: Shape, dtype_bytes: int) -> int:
  """KV-cache bytes of one token: ``n_layers x 2 x n_kv_heads x head_dim x dtype``."""
  return s.n_layers * 2 * s.n_kv_heads * s.head_dim * dtype_bytes


def decode_step_work(s: Shape, positions: Sequence[int], versions: int = 1,
                     dtype_bytes: int = 2) -> tuple[int, int]:
  """(bytes, FLOPs) of one decode step: one new token for every active slot.

  ``positions[i]``: slot i's cached tokens this step (the position its new
  token is written at). Bytes: ``versions`` parameter trees (each live
  version's rows run under its own params) plus the cache those slots read.
  FLOPs: ``2 * N`` per row plus attention over ``position + 1`` keys.
  """
  rows = len(positions)
  by = versions * param_read_bytes(s, max(1, rows // versions), dtype_bytes)
  by += sum(int(p) for p in positions) * kv_bytes_per_token(s, dtype_bytes)
  attn = 4 * s.n_layers * s.n_heads * s.head_dim * sum(int(p) + 1 for p in positions)
  return by, 2 * matmul_params(s) * rows + attn


def prefill_work(s: Shape, prompt_lens: Sequence[int], calls: int = 1,
                 dtype_bytes: int = 2) -> tuple[int, int]:
  """(bytes, FLOPs) of prefilling ``prompt_lens`` (in ``calls`` device calls).

  Bytes: the parameters once per call plus the KV entries written. FLOPs:
  every block on every token, the head on each prompt's last position only,
  causal attention ``2 * n_layers * n_heads * head_dim * T^2`` per prompt.
  """
  tokens = sum(int(t) for t in prompt_lens)
  by = calls * param_read_bytes(s, tokens // max(1, calls), dtype_bytes)
  by += tokens * kv_bytes_per_token(s, dtype_bytes)
  flops = 2 * s.n_layers * layer_matmul_params(s) * tokens
  flops += 2 * s.d_model * s.vocab_size * len(prompt_lens)
  flops += sum(2 * s.n_layers * s.n_heads * s.head_dim * int(t) ** 2 for t in prompt_lens)
  return by, flops


def learner_step_flops(s: Shape, rows: int, seq: int) -> int:
  """Model FLOPs of one train step: ``6 N tokens + 6 L T^2 H D`` per row (causal, fwd + bwd)."""
  tokens = rows * seq
  attn = 6 * s.n_layers * seq * seq * s.n_heads * s.head_dim * rows
  return 6 * matmul_params(s) * tokens + attn


def floor_seconds(work: Iterable[tuple[float, float]], bandwidth: float,
                  matmul_rate: float) -> float:
  """Sum over units of ``max(bytes / bandwidth, FLOPs / matmul_rate)`` (a roofline per unit)."""
  return sum(max(b / bandwidth, f / matmul_rate) for b, f in work)


# -------------------------------------------------------------------- figures
@dataclasses.dataclass
class Figure:
  """One row of the table.

  ``measured_s`` is the time the work took and ``work`` its (bytes, FLOPs)
  units; with the peaks they give the floor. ``unit`` decides how the floor
  is shown: a time (s, ms/step, s/step) scales down, a rate (*/s) up.
  ``goal``: (``"fraction"`` or ``"value"``, ``">="`` or ``"<="``, threshold).
  """

  section: str
  key: str
  label: str
  value: float | None
  unit: str
  measured_s: float | None = None
  work: list[tuple[float, float]] | None = None
  goal: tuple[str, str, float] | None = None
  note: str = ""
  # Ratio rows (K versions / 1 version): (numerator work, denominator work);
  # the floor shown is the ratio of their floors, and no fraction is given.
  ratio_of: tuple[list[tuple[float, float]], list[tuple[float, float]]] | None = None
  floor_value: float | None = None
  floor_s: float | None = None
  fraction: float | None = None

  def finish(self, peaks: dict[str, float]) -> None:
    """Computes the floor and the fraction of it from the run's measured peaks."""
    bw, mm = peaks["copy_bytes_per_s"], peaks["matmul_flops_per_s"]
    if self.ratio_of is not None:
      num, den = self.ratio_of
      self.floor_value = floor_seconds(num, bw, mm) / floor_seconds(den, bw, mm)
    if self.work is None or self.measured_s is None or self.value is None:
      return
    self.floor_s = floor_seconds(self.work, bw, mm)
    self.fraction = self.floor_s / self.measured_s
    if self.unit.endswith("/s"):
      self.floor_value = self.value / self.fraction
    else:
      self.floor_value = self.value * self.fraction

  @property
  def goal_met(self) -> bool | None:
    if self.goal is None:
      return None
    what, op, bound = self.goal
    x = self.fraction if what == "fraction" else self.value
    if x is None:
      return None
    return x >= bound if op == ">=" else x <= bound

  def goal_text(self) -> str:
    if self.goal is None:
      return ""
    what, op, bound = self.goal
    text = f"{op} {bound:.0%} of floor" if what == "fraction" else f"{op} {bound:g}{self.unit}"
    met = self.goal_met
    return text if met is None else f"{text} ({'met' if met else 'MISSED'})"

  def to_json(self) -> dict[str, Any]:
    d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("work", "ratio_of")}
    if self.work is not None:
      d["work_bytes"] = float(sum(b for b, _ in self.work))
      d["work_flops"] = float(sum(f for _, f in self.work))
    d["goal"] = self.goal_text() or None
    d["goal_met"] = self.goal_met
    return d


def _fmt(x: float | None, unit: str) -> str:
  if x is None:
    return "-"
  if unit == "bool":
    return "yes" if x else "no"
  if abs(x) >= 1e4:
    return f"{x / 1e3:,.1f}k"
  if abs(x) >= 100:
    return f"{x:,.0f}"
  if abs(x) >= 1:
    return f"{x:.2f}"
  return f"{x:.3g}"


def print_table(figures: Sequence[Figure]) -> None:
  w = max([len(f.label) for f in figures] + [10])
  print(f"\n{'figure':<{w}}  {'value':>10} {'unit':<9} {'floor':>10} {'of floor':>9}  goal / note")
  print("-" * (w + 60))
  section = None
  for f in figures:
    if f.section != section and section is not None:
      print()
    section = f.section
    frac = "-" if f.fraction is None else (f"{f.fraction:.1%}" if f.fraction >= 1e-3
                                           else f"{f.fraction:.1e}")
    tail = "; ".join(x for x in (f.goal_text(), f.note) if x)
    value = "-" if f.value is None else _fmt(f.value, f.unit)
    print(f"{f.label:<{w}}  {value:>10} {f.unit:<9} {_fmt(f.floor_value, f.unit):>10} "
          f"{frac:>9}  {tail}")
  sys.stdout.flush()


def _log(section: str, msg: str) -> None:
  print(f"[{section}] {msg}", flush=True)


# ---------------------------------------------------------------------- peaks
def measure_peaks(small: bool) -> dict[str, float]:
  """Copy bandwidth and bf16 matmul rate of ``jax.devices()[0]``, best of several."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  dev = jax.devices()[0]
  cpu = dev.platform == "cpu"
  n_copy = (4 << 20) if small else ((32 << 20) if cpu else (512 << 20))  # bf16 elements
  n_mm = 256 if small else (1024 if cpu else 8192)
  reps = 5 if cpu else 10

  def best(fn, arg) -> float:
    jax.block_until_ready(fn(arg))  # compile
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(arg))
      times.append(time.perf_counter() - t0)
    return min(times)

  # The faster of x + 1 in bf16 and the same add on its bits as uint16
  # (XLA:CPU's bf16 arithmetic is compute-bound; on a GPU both run at the
  # memory's speed). Not a plain copy: XLA may lower that to no kernel at all.
  def bits_add(a):
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, jnp.uint16) + 1,
                                        jnp.bfloat16)

  x = jax.device_put(jnp.ones((n_copy,), jnp.bfloat16), dev)
  copy_s = min(best(jax.jit(lambda a: a + 1), x), best(jax.jit(bits_add), x))
  del x
  a = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (n_mm, n_mm), jnp.bfloat16), dev)
  mm = jax.jit(lambda m: jnp.dot(m, m, preferred_element_type=jnp.float32))
  mm_s = best(mm, a)
  del a
  return {
      "copy_bytes_per_s": 2 * 2 * n_copy / copy_s,  # bf16 read + written
      "copy_array_bytes": 2 * n_copy,
      "matmul_flops_per_s": 2 * n_mm ** 3 / mm_s,
      "matmul_n": n_mm,
  }


# --------------------------------------------------------------------- import
def bench_import() -> list[Figure]:
  """``import jax_dora.rollout.engine`` in a fresh interpreter: what a server start pays."""
  code = (
      "import json, resource, sys, time\n"
      "t = time.perf_counter()\n"
      "import jax_dora.rollout.engine\n"
      "s = time.perf_counter() - t\n"
      # Peak RSS of this process image: /proc's VmHWM (ru_maxrss survives exec
      # on Linux, so it would report a large parent's size); ru_maxrss elsewhere.
      "try:\n"
      "  hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
      "  kib = int(hwm.split()[1])\n"
      "except OSError:\n"
      "  kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
      "print(json.dumps({'import_s': s, 'rss_kib': kib,"
      " 'tensorflow': 'tensorflow' in sys.modules, 'torch': 'torch' in sys.modules}))\n"
  )
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=600, env=dict(os.environ, PYTHONPATH=ROOT), check=True)
  wall = time.perf_counter() - t0
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  _log("import", f"{res['import_s']:.2f} s import, {wall:.2f} s process, "
       f"{res['rss_kib'] / 1024:.0f} MiB peak RSS, tensorflow={res['tensorflow']}")
  return [
      Figure("import", "import.seconds", "import jax_dora.rollout.engine", res["import_s"], "s"),
      Figure("import", "import.process_seconds", "  python -c ... wall (process)", wall, "s"),
      Figure("import", "import.peak_rss_mib", "  peak RSS", res["rss_kib"] / 1024, "MiB"),
      Figure("import", "import.tensorflow", "  tensorflow imported", float(res["tensorflow"]),
             "bool", note="torch imported too" if res["torch"] else ""),
  ]


# --------------------------------------------------------------------- decode
def _decode_hint_class() -> Any:
  """``DecodeHint`` where the engine has one (static decode programs), else None."""
  from jax_dora.rollout import engine as engine_mod  # pylint: disable=g-import-not-at-top
  return getattr(engine_mod, "DecodeHint", None)


def _step(engine, mv, state, hint_cls, max_position: int, version_rows: dict[int, int]):
  # Shim (issue 23): an engine whose generate takes a host-side DecodeHint
  # (an upper bound on slot positions, the rows of each version) gets one, so
  # its decode programs have static shapes; older engines take (params, state).
  if hint_cls is None:
    return engine.generate(mv, state)
  return engine.generate(mv, state, hint=hint_cls(max_position=max_position,
                                                  version_rows=version_rows))


def _fill_slots(engine, params: dict[int, Any], rows: dict[int, list[int]], prompt: int,
                rng: Any) -> Any:
  """A fresh decode state with ``rows[v]`` prefilled by version ``v`` (random prompts)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  state = engine.init_decode_state()
  for v, r in rows.items():
    if r:
      ctxs = [rng.integers(3, engine.tokenizer.vocab_size, size=prompt).astype(np.int32) for _ in r]
      state, _, _ = engine.prefill_insert_batch_async(params[v], v, ctxs, r, state)
  return state


def _run_steps(engine, mv, state, hint_cls, pos: int, n: int, version_rows: dict[int, int]):
  """``n`` decode steps from position ``pos`` (every slot advances together).

  Returns (state, last result, next position).
  """
  res = None
  for _ in range(n):
    state, res = _step(engine, mv, state, hint_cls, pos, version_rows)
    pos += 1
  return state, res, pos


def _rollout_cfg(shape: Shape, prompt: int, steps: int, profile: bool = False) -> Any:
  # Room for the prompt, a warm-up step, the timed steps (and the profiled ones).
  extra = PROFILE_STEPS if profile else 0
  return shape.model_config(prompt + steps + extra + 2, "bfloat16", "bfloat16")


def _random_params(engine, cfg, seed: int) -> Any:
  """A random param tree made directly on the engine's devices and layout (no host copy)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax_dora.model import init_params  # pylint: disable=g-import-not-at-top
  fn = jax.jit(lambda r: init_params(cfg, r), out_shardings=engine.param_sharding)
  return jax.block_until_ready(fn(jax.random.PRNGKey(seed)))


def bench_decode(shape: Shape, name: str, slots_list: Sequence[int], versions_list: Sequence[int],
                 prompt: int, steps: int, profile_dir: str | None) -> list[Figure]:
  """``DoraEngine.generate`` step time for every (slots, live versions) pair."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax_dora.model import CharTokenizer  # pylint: disable=g-import-not-at-top
  from jax_dora.rollout.engine import (  # pylint: disable=g-import-not-at-top
      DoraEngine,
      MultiVersionParams,
  )

  tok = CharTokenizer()
  cfg = _rollout_cfg(shape, prompt, steps, profile=bool(profile_dir))
  hint_cls = _decode_hint_class()
  _log("decode", f"DecodeHint {'passed' if hint_cls else 'not in this engine'}; "
       f"prompt {prompt}, {steps} timed steps after one step, behind a warm-up pass of the same"
       " steps")
  rng = np.random.default_rng(0)
  figures: list[Figure] = []
  params: dict[int, Any] = {}
  one_version: dict[int, tuple[float, list[tuple[int, int]]]] = {}  # slots -> (ms, work)
  profiled = False
  for slots in slots_list:
    engine = DoraEngine(cfg, tok, num_slots=slots, max_prefill_length=prompt, temperature=1.0,
                        seed=slots)
    for k in versions_list:
      for v in range(1, k + 1):
        if v not in params:  # one tree per version, shared by every engine (same device)
          params[v] = _random_params(engine, cfg, seed=v)
      rows = {v: list(range(v - 1, slots, k)) for v in range(1, k + 1)}
      version_rows = {v: len(r) for v, r in rows.items() if r}
      mv = MultiVersionParams({v: params[v] for v in version_rows}, tuple(version_rows))
      # Warm-up pass: the same steps, so every program the timed pass meets
      # (e.g. one per attention-length bucket) is compiled before the clock.
      extra = PROFILE_STEPS if (profile_dir and not profiled and k == 1) else 0
      t0 = time.perf_counter()
      state, res, _ = _run_steps(engine, mv, _fill_slots(engine, params, rows, prompt, rng),
                                 hint_cls, prompt, 1 + steps + extra, version_rows)
      jax.block_until_ready(res.data)
      warm_s = time.perf_counter() - t0
      del state, res
      state, res, pos = _run_steps(engine, mv, _fill_slots(engine, params, rows, prompt, rng),
                                   hint_cls, prompt, 1, version_rows)
      jax.block_until_ready(res.data)
      first = pos
      t0 = time.perf_counter()
      state, res, pos = _run_steps(engine, mv, state, hint_cls, pos, steps, version_rows)
      jax.block_until_ready((state.positions, res.data))
      wall = time.perf_counter() - t0
      got = int(np.asarray(res.data)[0, 2])  # tokens generated in slot 0, prefill's included
      if got != steps + 2:
        raise RuntimeError(f"slot 0 generated {got} tokens, expected {steps + 2}")
      bad = getattr(res, "hint_violated", None)  # engines with DecodeHint report a wrong one
      if bad is not None and np.any(np.asarray(bad)):
        raise RuntimeError("the engine reports the DecodeHint of the last timed step as violated")
      if profile_dir and not profiled and k == 1:
        with jax.profiler.trace(os.path.join(profile_dir, "decode")):
          state, res, pos = _run_steps(engine, mv, state, hint_cls, pos, PROFILE_STEPS,
                                       version_rows)
          jax.block_until_ready(res.data)
        profiled = True
      work = [decode_step_work(shape, [first + i] * slots, versions=len(version_rows))
              for i in range(steps)]
      ms = wall / steps * 1e3
      tag = f"{slots} slots, {k} version{'s' if k > 1 else ''}"
      goal = None
      if k == 1:
        goal = ("fraction", ">=", 0.5 if (name == "7b" and slots == 64) else 0.25)
      f_ms = Figure("decode", f"decode.slots{slots}.v{k}.ms_per_step", f"generate {tag}", ms,
                    "ms/step", measured_s=wall, work=work, goal=goal,
                    note=f"warm-up pass {warm_s:.1f} s")
      f_tps = Figure("decode", f"decode.slots{slots}.v{k}.tok_per_s", "  tok/s",
                     slots * steps / wall, "tok/s", measured_s=wall, work=work)
      figures += [f_ms, f_tps]
      _log("decode", f"{tag}: {ms:.2f} ms/step = {slots * steps / wall:,.0f} tok/s "
           f"(warm-up pass with compiles {warm_s:.1f} s)")
      if k == 1:
        one_version[slots] = (ms, work)
      elif slots in one_version:
        figures.append(Figure(
            "decode", f"decode.slots{slots}.v{k}.ratio", f"  {k} versions / 1 version",
            ms / one_version[slots][0], "x", ratio_of=(work, one_version[slots][1]),
            goal=("value", "<=", 1.2) if k == 2 else None,
            note="floor: the ratio of the two floors (each version's params are read)"))
      del state, res
    del engine
    gc.collect()
  return figures


# -------------------------------------------------------------------- prefill
def bench_prefill(shape: Shape, slots_list: Sequence[int], prompt: int, steps: int,
                  batch_tokens: int) -> list[Figure]:
  """Prompt tok/s of one admission round filling every slot (distinct prompts, no sharing)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax_dora.model import CharTokenizer  # pylint: disable=g-import-not-at-top
  from jax_dora.rollout.engine import DoraEngine  # pylint: disable=g-import-not-at-top

  tok = CharTokenizer()
  cfg = _rollout_cfg(shape, prompt, steps)
  rng = np.random.default_rng(1)
  figures = []
  params = None
  for slots in slots_list:
    engine = DoraEngine(cfg, tok, num_slots=slots, max_prefill_length=prompt, temperature=1.0,
                        share_prompt_prefill=False, prefill_batch_tokens=batch_tokens)
    if params is None:
      params = _random_params(engine, cfg, seed=1)
    ctxs = [rng.integers(3, tok.vocab_size, size=prompt).astype(np.int32) for _ in range(slots)]
    walls, work = [], None
    for r in range(4):  # round 0 compiles
      state = engine.init_decode_state()
      jax.block_until_ready(state)
      t0 = time.perf_counter()
      state, firsts, work = engine.prefill_insert_batch_async(params, 1, ctxs, list(range(slots)),
                                                              state)
      jax.block_until_ready((state, firsts[-1][0]))
      if r:
        walls.append(time.perf_counter() - t0)
      del state, firsts
    wall = float(np.median(walls))
    q, extra = divmod(slots, work.calls)  # prompts per call, as evenly as the engine splits them
    units = [prefill_work(shape, [prompt] * (q + (c < extra)), 1) for c in range(work.calls)]
    tps = work.requested_tokens / wall
    figures.append(Figure("prefill", f"prefill.slots{slots}.tok_per_s",
                          f"prefill {slots} x {prompt}-token prompts", tps, "tok/s",
                          measured_s=wall, work=units,
                          note=f"{work.calls} call(s) of <= {batch_tokens} tokens, median of 3"))
    _log("prefill", f"{slots} prompts: {wall * 1e3:.1f} ms = {tps:,.0f} tok/s ({work.calls} calls)")
    del engine
    gc.collect()
  return figures


# -------------------------------------------------------------------- learner
def _device_memory(dev: Any) -> int | None:
  """Bytes the allocator may use on ``dev``, where the backend says (GPU, TPU)."""
  try:
    return int((dev.memory_stats() or {}).get("bytes_limit", 0)) or None
  except Exception:  # pylint: disable=broad-except  (CPU backends may not implement it)
    return None


def bench_learner(shape: Shape, rows: int, seq: int, micro: int, chunk: int, steps: int,
                  profile_dir: str | None) -> list[Figure]:
  """Learner build, compile and train_step (f32 params, bf16 activations) on one device."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax_dora.config import base_config  # pylint: disable=g-import-not-at-top
  from jax_dora.learner.mesh import make_mesh  # pylint: disable=g-import-not-at-top
  from jax_dora.learner.train_state import (  # pylint: disable=g-import-not-at-top
      Learner,
      batch_shapes,
  )

  need = 16 * param_count(shape)  # float32 params, gradients, Adam's mu and nu
  limit = _device_memory(jax.devices()[0])
  if limit and need > 0.8 * limit:
    why = (f"skipped: f32 params, grads and Adam moments alone take {need / 2**30:.0f} GiB of the"
           f" device's {limit / 2**30:.0f} GiB")
    _log("learner", why)
    return [Figure("learner", "learner.skipped", "Learner.train_step", None, "s/step", note=why)]
  cfg = shape.model_config(seq + 1, "float32", "bfloat16")
  lc = base_config().learner.copy_and_resolve_references()
  lc.update(micro_batch_size=micro, logprob_chunk_size=chunk, remat="dots", seq_len_buckets="",
            group_micro_batches_by_length=False)
  mesh = make_mesh(jax.devices()[:1])
  t0 = time.perf_counter()
  learner = Learner(cfg, lc, mesh, seed=0)
  jax.block_until_ready(learner.state)
  build_s = time.perf_counter() - t0
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(learner.state))
  t0 = time.perf_counter()
  learner.compile_step(rows, seq + 1)
  compile_s = time.perf_counter() - t0
  _log("learner", f"build {build_s:.1f} s, compile {compile_s:.1f} s")

  rng = np.random.default_rng(0)
  shapes = batch_shapes(rows, seq + 1)
  batch = {k: np.zeros(s, d) for k, (s, d) in shapes.items()}
  batch["inputs"] = rng.integers(3, shape.vocab_size, size=shapes["inputs"][0]).astype(np.int32)
  batch["targets"] = rng.integers(3, shape.vocab_size, size=shapes["targets"][0]).astype(np.int32)
  batch["positions"][:] = np.arange(seq, dtype=np.int32)[None]
  batch["mask"][:] = 1.0
  # Near a random policy's log-prob, so importance ratios stay near 1.
  batch["behaviour_logprobs"][:] = -np.log(shape.vocab_size)
  batch["advantages"] = rng.standard_normal(rows).astype(np.float32)

  t0 = time.perf_counter()
  learner.train_step(batch)
  first_s = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    learner.train_step(batch)
    times.append(time.perf_counter() - t0)
  step_s = float(np.median(times))
  if profile_dir:
    with jax.profiler.trace(os.path.join(profile_dir, "learner")):
      learner.train_step(batch)
  flops = learner_step_flops(shape, rows, seq)
  tokens = rows * seq
  _log("learner", f"{step_s:.3f} s/step = {tokens / step_s:,.0f} tok/s"
       f" (first step {first_s:.2f} s)")
  what = (f"{rows} x {seq}, micro {micro}, chunk {chunk}, remat dots")
  figures = [
      Figure("learner", "learner.build_seconds", "Learner build (random init)", build_s, "s",
             measured_s=build_s, work=[(state_bytes, 0)],
             note=f"floor: writing the {state_bytes / 2**20:,.1f} MiB train state"),
      Figure("learner", "learner.compile_seconds", "  compile_step", compile_s, "s",
             note=f"first train_step {first_s:.2f} s"),
      Figure("learner", "learner.step_seconds", "Learner.train_step", step_s, "s/step",
             measured_s=step_s, work=[(0, flops)], note=f"{what}; of floor = MFU"),
      Figure("learner", "learner.tok_per_s", "  tok/s", tokens / step_s, "tok/s",
             measured_s=step_s, work=[(0, flops)], note=f"median of {steps}"),
  ]
  del learner
  gc.collect()
  return figures


# ------------------------------------------------------------------------- hf
def _hf_child(spec: dict[str, Any]) -> dict[str, Any]:
  """Runs in a child process: random Qwen2 in bf16, ``generate`` per slot count. No JAX here."""
  import torch  # pylint: disable=g-import-not-at-top

  device = spec["device"]
  if device == "auto":
    if not torch.cuda.is_available():
      return {"skipped": "no CUDA torch"}
    device = "cuda"
  import transformers  # pylint: disable=g-import-not-at-top

  s = spec["shape"]
  prompt, steps = spec["prompt"], spec["steps"]
  hf_cfg = transformers.Qwen2Config(
      vocab_size=s["vocab_size"], hidden_size=s["d_model"], intermediate_size=s["d_ff"],
      num_hidden_layers=s["n_layers"], num_attention_heads=s["n_heads"],
      num_key_value_heads=s["n_kv_heads"], max_position_embeddings=max(4096, prompt + steps),
      tie_word_embeddings=s["tie_embeddings"], rope_theta=s["rope_theta"], rms_norm_eps=1e-6)
  hf_cfg.head_dim = s["head_dim"]
  torch.manual_seed(0)
  default = torch.get_default_dtype()
  torch.set_default_dtype(torch.bfloat16)  # build in bf16: no f32 copy of a 7B model
  try:
    with torch.device(device):
      model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
  finally:
    torch.set_default_dtype(default)

  def sync():
    if device == "cuda":
      torch.cuda.synchronize()

  runs = []
  for slots in spec["slots"]:
    ids = torch.randint(3, s["vocab_size"], (slots, prompt), device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0,
              top_k=0, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
      model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
      sync()
      t0 = time.perf_counter()
      out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kw)
      sync()
      wall = time.perf_counter() - t0
    new = int(out.shape[1]) - prompt
    runs.append({"slots": slots, "seconds": wall, "new_tokens": new})
    del out
  return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
          "torch": torch.__version__, "transformers": transformers.__version__, "runs": runs}


def bench_hf(shape: Shape, slots_list: Sequence[int], prompt: int, steps: int,
             device: str) -> tuple[list[Figure], dict[str, Any]]:
  """HF ``generate`` in a child process; the figures get their floors later (from JAX's peaks)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
    res: dict[str, Any] = {"skipped": "no CUDA torch (torch or transformers not installed)"}
  else:
    spec = dict(shape=dataclasses.asdict(shape), slots=list(slots_list), prompt=prompt, steps=steps,
                device=device)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--hf-child", json.dumps(spec)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(HF_MARK)]
    if proc.returncode or not lines:
      raise RuntimeError(f"HF child failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len(HF_MARK):])
  if "skipped" in res:
    _log("hf", f"skipped ({res['skipped']})")
    return [Figure("hf", "hf.skipped", "HF generate", None, "tok/s",
                   note=f"skipped ({res['skipped']})")], res
  figures = []
  for run in res["runs"]:
    n, new, wall = run["slots"], run["new_tokens"], run["seconds"]
    # One prefill of the prompts (it samples the first token), then new - 1 decode steps.
    work = [prefill_work(shape, [prompt] * n, 1)]
    work += [decode_step_work(shape, [prompt + i] * n) for i in range(new - 1)]
    figures.append(Figure("hf", f"hf.slots{n}.tok_per_s", f"HF generate {n} slots (torch bf16)",
                          n * new / wall, "tok/s", measured_s=wall, work=work,
                          note=f"{new} new tokens, prefill included; {res['device']}"))
    _log("hf", f"{n} slots: {n * new / wall:,.0f} tok/s")
  return figures, res


# ----------------------------------------------------------------------- main
def _environment(args) -> dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    commit = ""
  return {
      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "backend": jax.default_backend(),
      "device_kind": dev.device_kind,
      "device_count": jax.device_count(),
      "jax": jax.__version__,
      "python": platform.python_version(),
      "host": platform.node(),
      "commit": commit,
      "shape": args.shape_name,
      "argv": sys.argv[1:],
      "compilation_cache": os.environ.get("JAX_COMPILATION_CACHE_DIR", ""),
  }


def _parse_ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
  ap.add_argument("--small", action="store_true",
                  help="tiny shape, few slots/steps/rows, CPU unless JAX_PLATFORMS says otherwise")
  ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
  ap.add_argument("--json", default="", help="write every figure here")
  ap.add_argument("--profile", default="", help="jax.profiler traces of one decode loop and one"
                  " learner step under DIR/decode and DIR/learner")
  ap.add_argument("--steps", type=int, default=None, help="timed decode steps (256; small 24)")
  ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (128; small 16)")
  ap.add_argument("--slots", default=None, help="decode slot counts (64,256; small 8)")
  ap.add_argument("--versions", default=None, help="live version counts (1,2,4; small 1,2)")
  ap.add_argument("--prefill-batch-tokens", type=int, default=4096,
                  help="tokens per prefill call (rollout.prefill_batch_tokens' default)")
  ap.add_argument("--learner-rows", type=int, default=None, help="64; small 8")
  ap.add_argument("--learner-seq", type=int, default=None, help="tokens per row (1024; small 64)")
  ap.add_argument("--learner-steps", type=int, default=None, help="timed train steps (3; small 2)")
  ap.add_argument("--hf-device", choices=("auto", "cpu"), default="auto",
                  help="auto: CUDA torch or skip; cpu: run HF generate on CPU torch anyway")
  ap.add_argument("--hf-child", default="", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.hf_child:
    print(HF_MARK + json.dumps(_hf_child(json.loads(args.hf_child))), flush=True)
    return {}

  sections = [x for x in args.sections.split(",") if x]
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    ap.error(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
  small = args.small
  shape = SMALL_SHAPE if small else SHAPES[args.shape]
  args.shape_name = "small" if small else args.shape
  steps = args.steps or (24 if small else 256)
  prompt = args.prompt or (16 if small else 128)
  # --small keeps the compiles few (they are most of its time on a CPU).
  slots_list = _parse_ints(args.slots or ("8" if small else "64,256"))
  versions_list = _parse_ints(args.versions or ("1,2" if small else "1,2,4"))
  rows = args.learner_rows or (8 if small else 64)
  seq = args.learner_seq or (64 if small else 1024)
  learner_steps = args.learner_steps or (2 if small else 3)
  micro, chunk = (4, 32) if small else (16, 512)
  if small:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a GPU run must say so explicitly
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

  t_start = time.perf_counter()
  figures: list[Figure] = []
  errors: dict[str, str] = {}
  seconds: dict[str, float] = {}
  hf_info: dict[str, Any] = {}

  def run(section: str, fn: Callable[[], list[Figure]]) -> None:
    if section not in sections:
      return
    t0 = time.perf_counter()
    try:
      figures.extend(fn())
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      errors[section] = f"{type(e).__name__}: {e}"
      figures.append(Figure(section, f"{section}.error", f"{section} FAILED", None, "",
                            note=errors[section][:200]))
    seconds[section] = time.perf_counter() - t0

  def hf() -> list[Figure]:
    out, info = bench_hf(shape, slots_list, prompt, steps, args.hf_device)
    hf_info.update(info)
    return out

  # Before JAX touches the device: torch gets the whole GPU.
  run("hf", hf)
  hf_figures = [f for f in figures if f.section == "hf"]
  figures = [f for f in figures if f.section != "hf"]

  env = _environment(args)
  print(f"== jax-dora accelerator benchmark: shape {env['shape']} "
        f"({param_count(shape) / 1e6:,.1f}M params) on {env['backend']} ({env['device_kind']}, "
        f"{env['device_count']} device(s)), "
        f"jax {env['jax']}, {env['date']}, commit {env['commit'] or '?'} ==", flush=True)
  t0 = time.perf_counter()
  peaks = measure_peaks(small)
  seconds["peaks"] = time.perf_counter() - t0
  _log("env", f"copy {peaks['copy_bytes_per_s'] / 1e9:,.1f} GB/s, bf16 matmul "
       f"{peaks['matmul_flops_per_s'] / 1e12:,.2f} TFLOP/s (n={peaks['matmul_n']})")
  if "env" in sections:
    figures += [
        Figure("env", "env.copy_gb_per_s", "device copy bandwidth (bf16)",
               peaks["copy_bytes_per_s"] / 1e9, "GB/s",
               note=f"{peaks['copy_array_bytes'] / 2**20:.0f} MiB array, read + written, best of"
               " x + 1 in bf16 and on its bits; the floors' bandwidth"),
        Figure("env", "env.matmul_tflop_per_s", "device bf16 matmul (f32 accumulation)",
               peaks["matmul_flops_per_s"] / 1e12, "TFLOP/s",
               note=f"n = {peaks['matmul_n']}; the floors' FLOP rate"),
    ]
  run("import", bench_import)
  run("decode", lambda: bench_decode(shape, args.shape_name, slots_list, versions_list, prompt,
                                     steps, args.profile or None))
  run("prefill", lambda: bench_prefill(shape, slots_list, prompt, steps,
                                       args.prefill_batch_tokens))
  run("learner", lambda: bench_learner(shape, rows, seq, micro, chunk, learner_steps,
                                       args.profile or None))
  figures += hf_figures
  # Engine vs HF at the same slot count (same shape, prompt and new tokens).
  engine_tps = {f.key.split(".")[1]: f.value for f in figures
                if f.key.startswith("decode.") and f.key.endswith(".v1.tok_per_s")}
  for f in list(hf_figures):
    n = f.key.split(".")[1]
    if f.value and n in engine_tps:
      figures.append(Figure("hf", f"hf.{n}.engine_over_hf",
                            f"  DoraEngine / HF tok/s ({n[5:]} slots)", engine_tps[n] / f.value,
                            "x", note="decode only vs generate with prefill"))
  for f in figures:
    f.finish(peaks)

  total = time.perf_counter() - t_start
  print(f"\n== {env['shape']}: {env['backend']} {env['device_kind']}, jax {env['jax']}, "
        f"{env['date']}; floors from copy {peaks['copy_bytes_per_s'] / 1e9:,.1f} GB/s and bf16 "
        f"matmul {peaks['matmul_flops_per_s'] / 1e12:,.2f} TFLOP/s measured above ==")
  print_table(figures)
  print(f"\nsections (s): " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items())
        + f"; total {total:.1f} s")
  result = {
      "meta": env,
      "peaks": peaks,
      "settings": dict(steps=steps, prompt=prompt, slots=slots_list, versions=versions_list,
                       learner_rows=rows, learner_seq=seq, learner_micro=micro,
                       logprob_chunk=chunk, learner_steps=learner_steps,
                       prefill_batch_tokens=args.prefill_batch_tokens, sections=sections),
      "figures": [f.to_json() for f in figures],
      "hf": hf_info,
      "errors": errors,
      "section_seconds": seconds,
      "total_seconds": total,
  }
  if args.json:
    with open(args.json, "w", encoding="utf-8") as fh:
      json.dump(result, fh, indent=1)
  if errors:
    print(f"FAILED sections: {sorted(errors)}", file=sys.stderr)
    sys.exit(1)
  return result


if __name__ == "__main__":
  main()
