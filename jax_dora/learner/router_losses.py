"""An MoE policy's router terms: load-balancing and z losses, and expert-load metrics.

Each MoE layer sows one reduced record (``jax_dora.model.moe``): real tokens
routed, top-k hits per expert, router probability mass per expert, the sum
of squared log-partition values and of router entropies. From those:

* ``load_balance``: transformers' ``load_balancing_loss_func`` (pooled over
  layers, the formula the checkpoint's ``router_aux_loss_coef`` belongs to):
  ``E * sum_e f_e * P_e`` with ``f_e`` the top-k hits of expert ``e`` and
  ``P_e`` its router probability mass, each over all layers' real tokens.
  1 * k when routing is uniform, up to E * k when one expert takes all.
* ``z_loss`` (ST-MoE): the mean over tokens and layers of
  ``logsumexp(router logits)^2``; keeps router logits small.
* metrics: ``moe/expert_load_max`` (max over layers of the busiest
  expert's hits over the mean), per layer ``moe/layer{i}/expert_load_max``,
  ``moe/router_entropy`` (nats per token), ``moe/dropped_tokens`` (top-k
  assignments that did not reach their expert: 0 by construction, as the
  routing is dropless; logged so a capacity limit added later would show),
  ``moe/route_mismatch`` (with recorded rollout routes in the batch: the
  share of them the learner's own top-k would not pick, whether or not
  ``learner.moe_routing=replay`` uses them; ``_stale0`` / ``_stale_gt0``: at
  trained tokens of the current / an older version, where the second adds
  the policy's change since to the engines' difference).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_dora.model.moe import ROUTER_STATS

_LAYER = re.compile(r"layers_(\d+)$")


def router_stats(intermediates: Any) -> dict[str, jax.Array] | None:
  """The sown records stacked over MoE layers (``[L]`` / ``[L, E]``), in layer order.

  ``intermediates``: the ``intermediates`` collection of one forward pass
  (unrolled ``layers_{i}`` or scanned ``layers`` with a leading layer axis).
  """
  tree = intermediates.get("intermediates", intermediates)
  records: list[tuple[int, dict[str, jax.Array]]] = []
  for name, sub in tree.items():
    stats = sub.get("mlp", {}).get(ROUTER_STATS) if isinstance(sub, dict) else None
    if stats is None:
      continue
    (rec,) = stats  # one sow per layer per call
    m = _LAYER.match(name)
    if m:
      records.append((int(m.group(1)), rec))
    elif name == "layers":  # scanned: already stacked
      return dict(rec)
  if not records:
    return None
  records.sort(key=lambda r: r[0])
  return {k: jnp.stack([r[k] for _, r in records]) for k in records[0][1]}


def router_losses(stats: dict[str, jax.Array], top_k: int, layer_ids: Sequence[int],
                  trained: jax.Array | None = None, staleness: jax.Array | None = None
                  ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """``(losses, metrics)`` from :func:`router_stats` (see the module doc); ``layer_ids``:
  the model's MoE layers (``ModelConfig.moe_layers``), which name the per-layer metrics.

  ``trained`` / ``staleness``: ``[B, T]`` the batch's mask and token staleness, which
  split ``moe/route_mismatch`` into the positions of trained tokens of the current
  version (``_stale0``) and of older ones (``_stale_gt0``): input position ``j``'s
  route was recorded by the version that sampled target ``j``.
  """
  tokens = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
  num_experts = stats["expert_hits"].shape[-1]
  f = jnp.sum(stats["expert_hits"], axis=0) / tokens
  p = jnp.sum(stats["prob_sum"], axis=0) / tokens
  losses = {
      "load_balance": num_experts * jnp.sum(f * p),
      "z_loss": jnp.sum(stats["z_sum"]) / tokens,
  }
  hits = stats["expert_hits"]
  per_layer = jnp.max(hits, axis=-1) / jnp.maximum(jnp.mean(hits, axis=-1), 1e-9)
  metrics = {
      "moe/load_balance_loss": losses["load_balance"],
      "moe/z_loss": losses["z_loss"],
      "moe/router_entropy": jnp.sum(stats["entropy_sum"]) / tokens,
      "moe/expert_load_max": jnp.max(per_layer),
      "moe/dropped_tokens": jnp.sum(stats["tokens"]) * top_k - jnp.sum(hits),
  }
  if "route_diff" in stats:
    # Recorded rollout routes the learner's own router would not pick.
    diff = jnp.sum(stats["route_diff"], axis=0)  # [B * T], summed over layers
    routed = jnp.sum(stats["routed"], axis=0)

    def share(where: jax.Array | float) -> jax.Array:
      return jnp.sum(diff * where) / jnp.maximum(jnp.sum(routed * where), 1.0)

    metrics["moe/route_mismatch"] = share(1.0)
    if trained is not None and staleness is not None:
      live = trained.reshape(-1) > 0
      fresh = staleness.reshape(-1) <= 0
      metrics["moe/route_mismatch_stale0"] = share(live & fresh)
      metrics["moe/route_mismatch_stale_gt0"] = share(live & ~fresh)
  for i, layer in enumerate(layer_ids):
    metrics[f"moe/layer{layer}/expert_load_max"] = per_layer[i]
  return losses, metrics
