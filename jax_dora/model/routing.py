"""Recorded MoE routing: what a rollout server returns for routing replay.

A record is ``[positions, moe_layers, k]`` expert ids, one row per token
the server ran through the model (prompt tokens in prefill, each sampled
token when it is fed back in decode), one column per MoE layer
(``ModelConfig.moe_layers``, in order). The dtype is the smallest unsigned
integer that holds every expert id plus a sentinel (``uint8`` up to 254
experts): 1 byte per route, ``moe_layers * k`` bytes per token (384 for
Qwen3-30B-A3B's 48 layers x top-8: 0.4% of the token's 96 KiB of bf16 KV
cache on the server).

The sentinel (the dtype's maximum) marks positions with no recorded route:
the last sampled token (never fed back), tool observations until the next
turn's prefill runs them, and rows a server without recording sends. The
learner routes such positions with its own top-k.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_dora.model.config import ModelConfig
from jax_dora.types import no_route

# The Flax collection MoE layers sow their chosen expert ids into.
ROUTING = "routing"
ROUTED_IDS = "ids"


def routing_dtype(num_experts: int) -> np.dtype:
  """The record's dtype: room for ids ``0..num_experts-1`` and the sentinel."""
  for dt in (np.uint8, np.uint16):
    if num_experts < np.iinfo(dt).max:
      return np.dtype(dt)
  return np.dtype(np.int32)


def sentinel(num_experts: int) -> int:
  """The "no route recorded" value of :func:`routing_dtype`."""
  return no_route(routing_dtype(num_experts))


def routing_shape(cfg: ModelConfig) -> tuple[int, int] | None:
  """``(moe_layers, k)`` of one position's record; ``None`` for a dense model."""
  if not cfg.num_experts:
    return None
  return (len(cfg.moe_layers), cfg.num_experts_per_tok)


def empty_record(cfg: ModelConfig, positions: int) -> np.ndarray:
  """``positions`` rows with no route recorded."""
  layers, k = routing_shape(cfg)
  return np.full((positions, layers, k), sentinel(cfg.num_experts), routing_dtype(cfg.num_experts))


def keep_recorded(recorded: np.ndarray | None, fresh: np.ndarray) -> np.ndarray:
  """``fresh`` routes, except where ``recorded`` (a prefix of the rows) has one.

  A resumed rollout or a tool turn re-prefills a context whose routes were
  recorded when its tokens were first run (and sampled from): those stay,
  so the record is the routing each token was generated under; only what
  was never run (an observation) takes the new prefill's.
  """
  if recorded is None or not len(recorded):
    return fresh
  out = fresh.copy()
  n = len(recorded)
  have = np.all(recorded != no_route(recorded.dtype), axis=(-2, -1))
  out[:n][have] = recorded[have]
  return out


def collect(variables: Any, cfg: ModelConfig) -> jax.Array:
  """The ``routing`` collection of one forward -> ``[B, T, moe_layers, k]`` record dtype.

  Unrolled layers sow under ``layers_{i}`` (ordered here by index, not by
  name: ``layers_10`` sorts before ``layers_2``); scanned ones under
  ``layers`` with a leading layer axis.
  """
  tree = variables.get(ROUTING, variables)
  dtype = routing_dtype(cfg.num_experts)
  if "layers" in tree:
    (ids,) = tree["layers"]["mlp"][ROUTED_IDS]  # [L, B, T, k]
    return jnp.moveaxis(ids, 0, 2).astype(dtype)
  per_layer = [tree[f"layers_{i}"]["mlp"][ROUTED_IDS][0] for i in cfg.moe_layers]
  return jnp.stack(per_layer, axis=2).astype(dtype)
