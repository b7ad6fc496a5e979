"""jax_dora.model: config, tokenizer, KV cache and the Linen transformer.

Logical parameter axis names (for ``nn.logical_to_mesh_sharding``):
``"vocab"``, ``"embed"``, ``"heads"``, ``"kv_heads"``, ``"kv"``, ``"mlp"``,
``"norm"``; see
``jax_dora.model.transformer`` for the per-parameter layout.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_dora.model.config import ModelConfig
from jax_dora.model.kv_cache import KVCache
from jax_dora.model.tokenizer import CharTokenizer
from jax_dora.model.logits import chunked_token_logprobs, suppress_mask, token_logprobs
from jax_dora.model.rope import apply_rope
from jax_dora.model.transformer import DECODE_ATTENTION, Transformer, head_weight

__all__ = [
    "DECODE_ATTENTION",
    "ModelConfig",
    "CharTokenizer",
    "KVCache",
    "Transformer",
    "apply_rope",
    "chunked_token_logprobs",
    "head_weight",
    "init_params",
    "param_logical_specs",
    "suppress_mask",
    "token_logprobs",
]


def _init_boxed(cfg: ModelConfig, rng: jax.Array) -> Any:
  # Param shapes do not depend on T, so a length-1 dummy keeps init cheap.
  tokens = jnp.zeros((1, 1), jnp.int32)
  positions = jnp.zeros((1, 1), jnp.int32)
  return Transformer(cfg).init(rng, tokens, positions)["params"]


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict[str, Any]:
  """Random params as a plain nested dict (partitioning metadata stripped)."""
  return nn.meta.unbox(_init_boxed(cfg, rng))


def param_logical_specs(cfg: ModelConfig) -> Any:
  """``PartitionSpec`` of logical axis names per param, same tree as ``init_params``.

  Computed from an abstract (``jax.eval_shape``) init, so it allocates nothing.
  """
  abstract = jax.eval_shape(lambda r: _init_boxed(cfg, r), jax.random.PRNGKey(0))
  return nn.get_partition_spec(abstract)
