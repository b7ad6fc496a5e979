"""Learner peak memory: chunked log-probs (and micro-batches, remat) vs full logits; an MoE case.

Usage::

  python benchmarks/learner_memory.py                 # V=151,936, T=2,048, 2 rows
  python benchmarks/learner_memory.py --seq_len=512 --rows=4
  python benchmarks/learner_memory.py --gemma --vocab=262144 --seq_len=1024 --experts=0

Compiles the real jitted train step (``Learner.compile_step``) of a small
GQA model with a Qwen-sized vocabulary under each memory setting, side by
side in one run, and prints XLA's buffer assignment for it
(``compiled.memory_analysis()``): the temporary working set of the step and
the peak (temporaries + arguments + outputs - donated aliases). Nothing is
executed, so the naive setting, which needs several GiB, can be measured on
any machine.

The prediction printed beside the measurement is a two-term model of the
step's temporaries: ``A + k·4·B·L·V`` bytes, where ``L`` is the number of
positions whose logits exist at once (``T`` naive, ``chunk`` chunked), ``k``
the number of float32 ``[B, L, V]`` buffers XLA keeps (logits, log-softmax,
their gradient), and ``A`` everything that does not grow with the vocabulary
(attention scores, MLP activations). ``A`` is measured by compiling the same
step with a 256-token vocabulary, ``k`` from the naive step; the chunked
step is then predicted at ``A + k·4·B·chunk·V``, i.e. smaller by
``(A + k·4BTV) / (A + k·4B·chunk·V)``, which tends to ``T / chunk`` as the
head dominates. Micro-batches of ``m`` rows shrink ``A`` by about ``B / m``.

``--gemma`` gives the model Gemma 2's block (GeGLU, sandwich and ``1 + w``
norms, scaled embeddings, local layers at window 512, attention and
final-logit soft-capping): the final cap adds one more float32 ``[B, L, V]``
buffer (the ``tanh``), so ``k`` grows by about one, and the soft-capped
attention is an einsum path whose ``[B, H, T, T]`` scores no fused kernel
avoids (on CPU the XLA path materialises them for every family anyway).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from jax_dora.config import base_config  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.learner.mesh import make_mesh  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.learner.train_state import Learner  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.model import ModelConfig  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

GIB = 2**30


def measure(model_cfg: ModelConfig, rows: int, seq_len: int, **learner) -> dict[str, float]:
  cfg = base_config().learner
  cfg.update(learner)
  lrn = Learner(model_cfg, cfg, make_mesh(jax.devices()[:1]), seed=0)
  mem = lrn.compile_step(rows, seq_len).memory_analysis()
  del lrn
  temp = mem.temp_size_in_bytes
  peak = temp + mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
  return {"temp": temp / GIB, "peak": peak / GIB}


def main(argv=None) -> dict[str, dict[str, float]]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--vocab", type=int, default=151_936)
  ap.add_argument("--seq_len", type=int, default=2048)
  ap.add_argument("--rows", type=int, default=2)
  ap.add_argument("--chunk", type=int, default=256)
  ap.add_argument("--d_model", type=int, default=256)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--experts", type=int, default=16,
                  help="MoE case: experts per layer (0 = no MoE case)")
  ap.add_argument("--top_k", type=int, default=4, help="MoE case: experts per token")
  ap.add_argument("--gemma", action="store_true",
                  help="Gemma 2's block (soft-caps, sandwich norms, local layers at window 512)")
  args = ap.parse_args(argv)

  gemma = dict(mlp_activation="gelu_tanh", norm_scale_offset=1.0, post_norms=True,
               scale_embeddings=True, attn_logit_softcap=50.0, final_logit_softcap=30.0,
               sliding_window=512, local_layers=tuple(range(0, args.layers, 2)))
  model_cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                          n_heads=4, n_kv_heads=2, d_ff=2 * args.d_model,
                          max_seq_len=args.seq_len, tie_embeddings=True,
                          **(gemma if args.gemma else {}))
  b, t, v, c = args.rows, args.seq_len - 1, args.vocab, args.chunk
  micro = max(1, b // 2)
  settings = {
      "naive (full [B,T,V] logits)": dict(logprob_chunk_size=0),
      f"chunked ({c} positions)": dict(logprob_chunk_size=c),
      f"chunked + micro-batch {micro}": dict(logprob_chunk_size=c, micro_batch_size=micro),
      f"chunked + micro {micro} + remat": dict(logprob_chunk_size=c, micro_batch_size=micro,
                                               remat="full"),
  }
  print(f"model: {'Gemma 2 block, ' if args.gemma else ''}d_model={args.d_model},"
        f" {args.layers} layers, vocab {v:,}; batch {b} rows x"
        f" {t} positions; XLA buffer assignment of the compiled train step")
  print(f"predicted: one float32 [B,T,V] tensor = {4 * b * t * v / GIB:.2f} GiB;"
        f" one [B,chunk,V] = {4 * b * c * v / GIB:.2f} GiB -> temporaries shrink by about"
        f" T/chunk = {t / c:.1f}x once the head dominates")
  results = {}
  for name, kw in settings.items():
    results[name] = measure(model_cfg, b, args.seq_len, **kw)
  names = list(results)
  small = dataclasses.replace(model_cfg, vocab_size=256)
  a = measure(small, b, args.seq_len, logprob_chunk_size=0)["temp"]
  naive = results[names[0]]["temp"]
  full_logits = 4 * b * t * v / GIB
  k = (naive - a) / full_logits
  predicted = a + k * 4 * b * c * v / GIB
  print(f"{'setting':<34} {'temp GiB':>9} {'peak GiB':>9} {'temp ratio':>11} {'peak ratio':>11}")
  for name, r in results.items():
    print(f"{name:<34} {r['temp']:>9.2f} {r['peak']:>9.2f} {naive / r['temp']:>10.1f}x"
          f" {results[names[0]]['peak'] / r['peak']:>10.1f}x")
  print(f"model of the temporaries: A = {a:.2f} GiB (vocabulary-independent, measured at V=256),"
        f" k = {k:.2f} float32 [B,T,V] buffers in the naive step")
  print(f"chunked, predicted: {predicted:.2f} GiB = {naive / predicted:.1f}x below naive;"
        f" measured: {results[names[1]]['temp']:.2f} GiB = {naive / results[names[1]]['temp']:.1f}x")
  results["model"] = {"A": a, "k": k, "predicted_chunked_temp": predicted}
  if args.experts:
    results.update(moe_case(model_cfg, args, c, micro))
  return results


def moe_case(dense: ModelConfig, args, chunk: int, micro: int) -> dict[str, dict[str, float]]:
  """An MoE model against the dense model of the same active FFN width, both chunked.

  Two predictions of what MoE adds to the step's temporaries, per MoE layer,
  float32, for ``N`` tokens routed to ``k`` of ``E`` experts of width ``F``:

  * a native grouped matmul (the TPU/GPU kernels ``ragged_dot`` lowers to):
    the expert activations ``[N*k, F]`` weigh what the dense model's
    ``[N, k*F]`` do; MoE adds the routed token copy and the expert outputs
    before the weighted sum (``2 x [N*k, D]``) and the router's ``[N, E]``
    logits and probabilities;
  * XLA:CPU, which expands ``ragged_dot`` into one masked copy of its left
    operand per expert followed by a dense dot (measured: a ``[4096, 64] x
    [16, 64, 32]`` ragged dot holds 16 MiB of temporaries = 16 x the 1 MiB
    operand): ``E x [N*k, D]`` twice (gate, up) and ``E x [N*k, F]`` (down).
  """
  e, k = args.experts, args.top_k
  f = dense.d_ff // k
  moe = dataclasses.replace(dense, num_experts=e, num_experts_per_tok=k, moe_d_ff=f)
  b, t, d = args.rows, args.seq_len - 1, dense.d_model
  n = b * t
  kw = dict(logprob_chunk_size=chunk)
  out = {f"dense FFN {dense.d_ff} (chunked)": measure(dense, b, args.seq_len, **kw),
         f"MoE {e} experts x {f}, top-{k} (chunked)": measure(moe, b, args.seq_len, **kw)}
  (dn, dr), (mn, mr) = out.items()
  native = dense.n_layers * 4 * (2 * n * k * d + 2 * n * e) / GIB
  cpu = dense.n_layers * 4 * e * n * k * (2 * d + f) / GIB
  measured = mr["temp"] - dr["temp"]
  print(f"MoE case: {e} experts of width {f}, top-{k} (active FFN width {k * f} = the dense"
        f" model's {dense.d_ff}); extra temporaries predicted: {native:.3f} GiB with a native"
        f" grouped matmul, {cpu:.3f} GiB with XLA:CPU's per-expert expansion of ragged_dot")
  print(f"{dn:<34} {dr['temp']:>9.3f} GiB temp {dr['peak']:>9.3f} GiB peak")
  print(f"{mn:<34} {mr['temp']:>9.3f} GiB temp {mr['peak']:>9.3f} GiB peak"
        f"  (measured extra {measured:+.3f} GiB on {jax.devices()[0].platform})")
  del micro
  return {"moe": {"dense_temp": dr["temp"], "moe_temp": mr["temp"], "predicted_native": native,
                  "predicted_cpu_expansion": cpu, "dense_peak": dr["peak"], "moe_peak": mr["peak"]}}


if __name__ == "__main__":
  main()
