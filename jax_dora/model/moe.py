"""Mixture-of-experts feed-forward (Qwen3-MoE): float32 router, dropless top-k, grouped matmuls.

Routing follows transformers' ``Qwen3MoeSparseMoeBlock`` exactly: router
logits and their softmax in float32, the top ``k`` probabilities (optionally
renormalised to sum to 1), each token's output the weighted sum of its ``k``
experts' SwiGLU outputs. Nothing is dropped: there is no capacity factor, so
every token reaches all of its experts whatever the load, and the result
equals transformers' for any routing (a capacity limit would make the
learner's output depend on which other tokens share its batch).

The experts run as grouped matmuls over tokens sorted by expert
(``jax.lax.ragged_dot``): each expert multiplies exactly the rows routed to
it, so the work is ``k`` dense FFNs' worth per token. The alternative,
one-hot dispatch/combine einsums (GShard, MaxText's "dense" path), costs
``num_experts / k`` times the FLOPs (16x for Qwen3-30B-A3B's 128 experts
and top-8) plus ``[tokens, experts, capacity]`` dispatch tensors, and
needs a capacity to bound them. DESIGN.md, "Mixture of experts".

Router statistics for the load-balancing and z losses and the expert-load
metrics are ``sow``-n into the ``intermediates`` collection (one reduced
record per layer, not per-token tensors); callers that do not ask for the
collection pay nothing.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_dora.model.config import ModelConfig
from jax_dora.model.mlp import MLP
from jax_dora.model.routing import ROUTED_IDS, ROUTING, sentinel

# The name of the per-layer record in the ``intermediates`` collection.
ROUTER_STATS = "router_stats"


def route(logits: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
  """``(weights [N, k] float32, expert ids [N, k] int32)`` from float32 router logits.

  The weights are gathered from the full softmax (not from probabilities
  already zeroed outside the top-k), so the router gets a gradient through
  every selected expert's probability, and through the normaliser to all.
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, ids = jax.lax.top_k(probs, k)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, ids.astype(jnp.int32)


def replayed_weights(logits: jax.Array, ids: jax.Array, norm_topk_prob: bool) -> jax.Array:
  """Routing replay: the weights of recorded expert ``ids [N, k]`` under the live router.

  The experts are the ones the sampler used (so the learner's forward is the
  sampler's routing), but their weights come from this forward's full
  softmax, so the router is still trained. Gathering instead from
  probabilities already zeroed outside the learner's own top-k gives a
  recorded expert the learner would not have picked weight 0 and no
  gradient: the known pitfall (tests/test_moe.py checks it does not happen).
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights = jnp.take_along_axis(probs, ids.astype(jnp.int32), axis=-1)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights


def grouped_swiglu(x: jax.Array, ids: jax.Array, weights: jax.Array, wi_0: jax.Array,
                   wi_1: jax.Array, wo: jax.Array) -> jax.Array:
  """``sum_j weights[n, j] * FFN_{ids[n, j]}(x[n])`` with one grouped matmul per weight.

  Args:
    x: ``[N, D]`` tokens.
    ids, weights: ``[N, k]`` routed experts and their weights (``x``'s dtype).
    wi_0, wi_1: ``[E, D, F]`` gate and up projections; ``wo``: ``[E, F, D]``.
  """
  n, k = ids.shape
  num_experts = wi_0.shape[0]
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
  rows = x[order // k]  # [N*k, D]
  group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  gate = jax.lax.ragged_dot(rows, wi_0.astype(x.dtype), group_sizes)
  up = jax.lax.ragged_dot(rows, wi_1.astype(x.dtype), group_sizes)
  out = jax.lax.ragged_dot(nn.silu(gate) * up, wo.astype(x.dtype), group_sizes)  # [N*k, D]
  out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
  unsorted = jnp.zeros_like(out).at[order].set(out)  # back to [token, j] order
  return jnp.sum(unsorted.reshape(n, k, -1), axis=1)


def all_experts_swiglu(x: jax.Array, ids: jax.Array, weights: jax.Array, wi_0: jax.Array,
                       wi_1: jax.Array, wo: jax.Array) -> jax.Array:
  """:func:`grouped_swiglu`'s result with every token through every expert.

  ``E / k`` times the FLOPs, weights 0 outside each token's top-k. The CPU
  path (``model.moe_impl=auto``): XLA:CPU expands ``ragged_dot`` into one
  masked copy of the rows per expert and a dense product, so there three
  plain batched matmuls are several times faster (``benchmarks/
  moe_grouped_matmul.py --small``: 4.6x vs 32x the floor).
  """
  n, k = ids.shape
  num_experts = wi_0.shape[0]
  gate = jnp.einsum("nd,edf->enf", x, wi_0.astype(x.dtype))
  up = jnp.einsum("nd,edf->enf", x, wi_1.astype(x.dtype))
  out = jnp.einsum("enf,efd->end", nn.silu(gate) * up, wo.astype(x.dtype))  # [E, N, D]
  combine = jnp.zeros((n, num_experts), x.dtype).at[jnp.arange(n)[:, None], ids].add(weights)
  return jnp.einsum("end,ne->nd", out, combine)


def moe_implementation(cfg: ModelConfig) -> str:
  """The experts' matmul ``model.moe_impl`` picks here: ``ragged`` or ``dense``."""
  if cfg.moe_impl != "auto":
    return cfg.moe_impl
  return "dense" if jax.default_backend() == "cpu" else "ragged"


class MoE(nn.Module):
  """The mixture-of-experts feed-forward of one block (``cfg.is_moe_layer``).

  Params: ``router/kernel [embed, expert]``, ``wi_0``/``wi_1 [expert,
  embed, mlp]``, ``wo [expert, mlp, embed]`` (logical axes; the ``expert``
  axis is what expert parallelism shards).
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, valid: jax.Array | None = None,
               recorded_ids: jax.Array | None = None, replay: bool = True) -> jax.Array:
    """``x [B, T, D]``; ``valid [B, T]`` marks real tokens for the router statistics.

    ``recorded_ids [B, T, k]``: the experts a rollout server routed each
    token to (``jax_dora.model.routing``; the sentinel = none recorded).
    With ``replay`` they are used instead of this router's top-k (routing
    replay; unrecorded positions take the top-k); either way the share of
    recorded routes this router would not have picked is counted in the
    router statistics (``route_diff`` / ``routed``).
    """
    cfg = self.cfg
    e, f, d = cfg.num_experts, cfg.moe_d_ff, cfg.d_model
    k = cfg.num_experts_per_tok
    init = nn.initializers.lecun_normal()
    logits = nn.Dense(
        e, use_bias=False, dtype=jnp.float32, param_dtype=cfg.jnp_param_dtype,
        kernel_init=nn.with_logical_partitioning(init, ("embed", "expert")), name="router",
    )(x.astype(jnp.float32))
    b, t = x.shape[:2]
    flat_logits = logits.reshape(b * t, e)
    weights, ids = route(flat_logits, k, cfg.norm_topk_prob)
    diff = None
    if recorded_ids is not None:
      rec = recorded_ids.reshape(b * t, k).astype(jnp.int32)
      has = jnp.all(rec != sentinel(e), axis=-1)  # [N]: a route was recorded
      # Recorded experts the live router's top-k does not contain, per token.
      diff = jnp.where(has, k - jnp.sum(jnp.any(rec[:, :, None] == ids[:, None, :], -1), -1), 0)
      diff = (diff, has)
      if replay:
        ids = jnp.where(has[:, None], rec, ids)
        weights = replayed_weights(flat_logits, ids, cfg.norm_topk_prob)
    if self.is_mutable_collection(ROUTING):
      self.sow(ROUTING, ROUTED_IDS, ids.reshape(b, t, k))

    def expert_param(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
      return self.param(name, nn.with_logical_partitioning(
          nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                           out_axis=-1, batch_axis=(0,)), axes),
                        shape, cfg.jnp_param_dtype)

    wi_0 = expert_param("wi_0", (e, d, f), ("expert", "embed", "mlp"))
    wi_1 = expert_param("wi_1", (e, d, f), ("expert", "embed", "mlp"))
    wo = expert_param("wo", (e, f, d), ("expert", "mlp", "embed"))
    experts = grouped_swiglu if moe_implementation(cfg) == "ragged" else all_experts_swiglu
    out = experts(x.reshape(b * t, d), ids, weights.astype(x.dtype), wi_0, wi_1, wo)
    self._sow_stats(flat_logits, ids, None if valid is None else valid.reshape(-1), diff)
    out = out.reshape(b, t, d)
    if cfg.shared_expert_d_ff:
      # Qwen2-MoE: a dense expert every token passes through, scaled by a
      # sigmoid gate of the token (``mlp.shared_expert``, ``mlp.shared_expert_gate``).
      shared = MLP(cfg, cfg.shared_expert_d_ff, name="shared_expert")(x)
      gate = nn.Dense(1, use_bias=False, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
                      kernel_init=nn.with_logical_partitioning(init, ("embed", "norm")),
                      name="shared_expert_gate")(x)
      out = out + nn.sigmoid(gate) * shared
    return out

  def _sow_stats(self, logits: jax.Array, ids: jax.Array, valid: jax.Array | None,
                 diff: tuple[jax.Array, jax.Array] | None) -> None:
    """Per-layer sums for the auxiliary losses and the load metrics (masked to real tokens);
    ``diff``: per token, recorded routes the live top-k misses, and whether one was recorded."""
    if not self.is_mutable_collection("intermediates"):
      return
    e = self.cfg.num_experts
    w = jnp.ones(logits.shape[:1], jnp.float32) if valid is None else valid.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    hits = jnp.zeros((e,), jnp.float32).at[ids.reshape(-1)].add(
        jnp.repeat(w, ids.shape[1]))
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
    stats = {
        "tokens": jnp.sum(w),  # real tokens routed
        "expert_hits": hits,  # [E] top-k assignments per expert
        "prob_sum": jnp.sum(probs * w[:, None], axis=0),  # [E] router probability mass
        "z_sum": jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * w),
        "entropy_sum": jnp.sum(entropy * w),
    }
    if diff is not None:
      # Per token (the learner splits them by the staleness of the version
      # that recorded them): recorded routes the live top-k misses, and routes recorded.
      per_token, has = diff
      stats["route_diff"] = per_token * w
      stats["routed"] = has * w * ids.shape[1]
    self.sow("intermediates", ROUTER_STATS, stats)
