"""jax_dora.model: config, tokenizer, KV cache and the Linen transformer.

Logical parameter axis names (for ``nn.logical_to_mesh_sharding``):
``"vocab"``, ``"embed"``, ``"heads"``, ``"kv_heads"``, ``"kv"``, ``"mlp"``,
``"norm"``; see
``jax_dora.model.transformer`` for the per-parameter layout.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_dora.model.config import ModelConfig
from jax_dora.model.kv_cache import KVCache
from jax_dora.model.tokenizer import CharTokenizer
from jax_dora.model.logits import chunked_token_logprobs, suppress_mask, token_logprobs
from jax_dora.model.rope import apply_rope
from jax_dora.model.transformer import (
    DECODE_ATTENTION,
    Transformer,
    head_logits,
    head_weight,
    stack_layers,
    unstack_layers,
)

__all__ = [
    "DECODE_ATTENTION",
    "ModelConfig",
    "CharTokenizer",
    "KVCache",
    "INIT_KEY_IMPL",
    "Transformer",
    "abstract_boxed_params",
    "abstract_params",
    "apply_rope",
    "boxed_init",
    "chunked_token_logprobs",
    "head_logits",
    "head_weight",
    "init_key",
    "init_params",
    "param_logical_specs",
    "stack_layers",
    "suppress_mask",
    "token_logprobs",
    "unstack_layers",
]


def _init_boxed(cfg: ModelConfig, rng: jax.Array) -> Any:
  # Param shapes do not depend on T, so a length-1 dummy keeps init cheap.
  tokens = jnp.zeros((1, 1), jnp.int32)
  positions = jnp.zeros((1, 1), jnp.int32)
  return Transformer(cfg).init(rng, tokens, positions)["params"]


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict[str, Any]:
  """Random params as a plain nested dict (partitioning metadata stripped)."""
  return nn.meta.unbox(_init_boxed(cfg, rng))


# Key implementation of the learner's random init (``init_key``). Threefry, the
# default, hashes 20 rounds per random word, and the init program of a 0.5B
# model holds ~170 such generators (one per tensor) for XLA to compile. XLA's
# RngBitGenerator ("unsafe_rbg": also for key splits) compiles that program in
# ~0.6x the time (CPU, 16 -> 10 s) and, without TPU's
# --xla_tpu_spmd_rng_bit_generator_unsafe, gives the same values on every
# sharding. Its stream is another (equally distributed) draw for a seed than
# threefry's. Only random init uses it (tests, benchmarks, from-scratch runs;
# a checkpoint import never draws). JAX_DORA_INIT_KEY_IMPL=threefry2x32
# restores the old draws.
INIT_KEY_IMPL = os.environ.get("JAX_DORA_INIT_KEY_IMPL", "unsafe_rbg")


def init_key(seed: int) -> jax.Array:
  """The typed PRNG key the learner's random init draws from (``INIT_KEY_IMPL``)."""
  return jax.random.key(seed, impl=INIT_KEY_IMPL)


@functools.cache
def boxed_init(cfg: ModelConfig) -> Callable[[jax.Array], Any]:
  """``key -> boxed params`` of ``cfg``: the Flax init, jitted, one function per config.

  Tracing the Flax init walks the whole model (a forward pass at length 1)
  in Python, about a second at 0.5B. Every abstract shape
  (``abstract_params``, ``param_logical_specs``) and every jitted program
  that initialises params (the learner's, called inside its own ``jit``)
  goes through this one function object, so JAX's trace cache traces it once
  per process and key type, not once per caller.
  """
  return jax.jit(functools.partial(_init_boxed, cfg))


def abstract_boxed_params(cfg: ModelConfig) -> Any:
  """``ShapeDtypeStruct`` per param inside its ``nn.Partitioned`` box (logical axis names)."""
  return jax.eval_shape(boxed_init(cfg), jax.eval_shape(init_key, 0))


def abstract_params(cfg: ModelConfig) -> dict[str, Any]:
  """``ShapeDtypeStruct`` per param, same tree as ``init_params``; allocates nothing."""
  return nn.meta.unbox(abstract_boxed_params(cfg))


def param_logical_specs(cfg: ModelConfig) -> Any:
  """``PartitionSpec`` of logical axis names per param, same tree as ``init_params``.

  Computed from an abstract (``jax.eval_shape``) init, so it allocates nothing.
  """
  return nn.get_partition_spec(abstract_boxed_params(cfg))
