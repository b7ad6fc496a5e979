"""How per-token losses become one number: ``learner.loss_aggregation``.

Each returns per-token weights ``[B, T]`` (zero on padding) with
``loss = sum(per_token * weights)``. The normalisers come from the *whole*
(mini)batch (:class:`BatchTotals`), never from a micro-batch, so gradient
accumulation over micro-batches adds up to exactly the full batch's loss.

* ``token_mean`` (DAPO): every trained token weighs the same, so long answers
  are not down-weighted per token.
* ``seq_mean_token_mean`` (GRPO paper): mean over each sequence, then over
  sequences; a token of a long answer weighs less.
* ``seq_mean_token_sum_norm`` (Dr.GRPO): token sums divided by a constant
  (rows x ``learner.loss_norm_length``), which removes GRPO's length bias.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dora.learner.losses.registry import AGGREGATIONS
from jax_dora.learner.losses.settings import LossSettings


class BatchTotals(NamedTuple):
  """Counts over the whole (mini)batch a loss is normalised by."""

  tokens: jax.Array  # trained tokens (mask sum), >= 1
  sequences: jax.Array  # rows with at least one trained token, >= 1
  rows: jax.Array  # rows, trained or not
  fresh_tokens: jax.Array  # tokens sampled by the current version
  stale_tokens: jax.Array  # tokens sampled by an older version

  @classmethod
  def of(cls, mask: jax.Array, token_staleness: jax.Array, xp=jnp) -> BatchTotals:
    """Totals of a batch; ``xp=numpy`` computes them on the host (the
    length-grouped learner step, whose micro-batches never see the whole batch)."""
    mask = mask.astype(xp.float32)
    fresh = (mask * (token_staleness <= 0)).sum()
    return cls(
        tokens=xp.maximum(mask.sum(), xp.float32(1.0)),
        sequences=xp.maximum((mask.sum(-1) > 0).sum().astype(xp.float32), xp.float32(1.0)),
        rows=xp.asarray(mask.shape[0], xp.float32),
        fresh_tokens=fresh,
        stale_tokens=mask.sum() - fresh,
    )


@AGGREGATIONS.register("token_mean")
def token_mean(mask: jax.Array, totals: BatchTotals, s: LossSettings) -> jax.Array:
  del s
  return mask / totals.tokens


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(mask: jax.Array, totals: BatchTotals, s: LossSettings) -> jax.Array:
  del s
  length = jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
  return mask / (length * totals.sequences)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(mask: jax.Array, totals: BatchTotals, s: LossSettings) -> jax.Array:
  return mask / (totals.rows * float(s.norm_length))
