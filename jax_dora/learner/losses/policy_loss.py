"""The learner's loss: objective x correction x aggregation (+ KL), with metrics.

One call per (micro-)batch. The pieces are chosen by name from the registries
(:mod:`registry`); this module only wires them and measures what async
training needs to see every step: how far the importance weights stray, how
many tokens the clip or the correction touched, and how far the learner's
log-probs are from the behaviour log-probs the rollout reported, split by
tokens sampled by the current version (pure engine mismatch) and by older
versions (staleness on top).

Metric keys ending in ``_max`` / ``_min`` combine across micro-batches by
max / min; every other metric is already normalised by whole-batch totals and
combines by sum.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dora.learner.losses.aggregation import BatchTotals
from jax_dora.learner.losses.objectives import ObjectiveInputs
from jax_dora.learner.losses.registry import AGGREGATIONS, CORRECTIONS, OBJECTIVES
from jax_dora.learner.losses.settings import LossSettings

sg = jax.lax.stop_gradient


class LossOutput(NamedTuple):
  loss: jax.Array
  metrics: dict[str, jax.Array]


def k3(log_ratio: jax.Array) -> jax.Array:
  """Schulman's k3 estimator ``r - 1 - log r`` of KL(p || q), ``log r = log q - log p``, x ~ p."""
  return jnp.exp(log_ratio) - 1.0 - log_ratio


def loglinear_proximal(logprobs: jax.Array, behaviour_logprobs: jax.Array,
                       token_staleness: jax.Array) -> jax.Array:
  """AReaL's log-linear stand-in for pi_prox without a second forward pass.

  ``log pi_prox ~= log pi_b + alpha (log pi - log pi_b)`` with
  ``alpha = (v_prox - v_b) / (v_theta - v_b) = s / (s + 1)`` for a token
  ``s`` versions stale (the step produces ``v_theta = v_prox + 1``): tokens
  of the current version keep their behaviour log-prob, old tokens move
  towards the learner's.
  """
  s = jnp.maximum(token_staleness.astype(jnp.float32), 0.0)
  alpha = s / (s + 1.0)
  return sg(behaviour_logprobs + alpha * (logprobs - behaviour_logprobs))


def policy_loss(
    logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    settings: LossSettings,
    *,
    proximal_logprobs: jax.Array | None = None,
    token_staleness: jax.Array | None = None,
    totals: BatchTotals | None = None,
    ref_logprobs: jax.Array | None = None,
) -> LossOutput:
  """Loss and metrics on ``[B, T]`` token arrays; ``advantages`` is ``[B]``.

  ``proximal_logprobs`` defaults to ``sg(logprobs)``: exact when the step
  takes one optimizer update from the current version's parameters.
  ``totals`` are the whole batch's counts (default: this batch's).
  ``ref_logprobs`` (needed when ``settings.kl_coef > 0``) adds
  ``kl_coef * k3(KL(pi || pi_ref))`` with the same aggregation.
  """
  s = settings
  mask = mask.astype(jnp.float32)
  staleness = jnp.zeros_like(mask) if token_staleness is None else token_staleness
  totals = BatchTotals.of(mask, staleness) if totals is None else totals
  prox = sg(logprobs) if proximal_logprobs is None else sg(proximal_logprobs)
  log_rho = (prox - behaviour_logprobs) * mask
  corr = CORRECTIONS.get(s.correction)(log_rho, mask, s)
  obj = OBJECTIVES.get(s.loss)(ObjectiveInputs(
      logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, proximal_logprobs=prox,
      log_rho=log_rho, log_weight=sg(corr.log_weight),
      advantages=advantages[:, None].astype(jnp.float32), mask=mask), s)
  weights = AGGREGATIONS.get(s.aggregation)(mask, totals, s)
  pg_loss = (obj.per_token * corr.keep * weights).sum()
  if s.kl_coef > 0.0:
    if ref_logprobs is None:
      raise ValueError("kl_coef > 0 needs ref_logprobs")
    kl = (k3(ref_logprobs - logprobs) * weights).sum()
  else:
    kl = jnp.zeros(())
  loss = pg_loss + s.kl_coef * kl

  def mean_over(x: jax.Array, tokens: jax.Array, count: jax.Array) -> jax.Array:
    """Mean of ``x`` over the ``tokens`` mask, whose whole-batch size is ``count``."""
    return (x * tokens).sum() / jnp.maximum(count, 1.0)

  def token_mean(x: jax.Array) -> jax.Array:
    return mean_over(x, mask, totals.tokens)

  live = mask > 0
  is_weight = jnp.exp(corr.log_weight)
  mismatch = (sg(logprobs) - behaviour_logprobs) * mask
  fresh = mask * (staleness <= 0)
  stale = mask - fresh
  metrics = {
      "pg_loss": pg_loss,
      "kl": kl,
      "ratio_mean": token_mean(obj.ratio),
      "clip_frac_low": token_mean(obj.clipped_low),
      "clip_frac_high": token_mean(obj.clipped_high),
      "clip_frac": token_mean(obj.clipped_low + obj.clipped_high),
      "is_weight_mean": token_mean(is_weight),
      "is_weight_max": jnp.where(live, is_weight, 0.0).max(),
      "is_weight_min": jnp.where(live, is_weight, jnp.inf).min(),
      "is_truncated_frac": token_mean(corr.affected) if s.correction == "tis" else jnp.zeros(()),
      "is_masked_frac": token_mean(1.0 - corr.keep),
      # Learner vs behaviour log-probs of the same tokens (rollout engine
      # mismatch, plus staleness for tokens of older versions).
      "mismatch/log_ratio_mean": token_mean(mismatch),
      "mismatch/abs_log_ratio_mean": token_mean(jnp.abs(mismatch)),
      "mismatch/kl_k3": token_mean(k3(mismatch)),
      "mismatch/log_ratio_mean_stale0": mean_over(mismatch, fresh, totals.fresh_tokens),
      "mismatch/kl_k3_stale0": mean_over(k3(mismatch), fresh, totals.fresh_tokens),
      "mismatch/log_ratio_mean_stale_gt0": mean_over(mismatch, stale, totals.stale_tokens),
      "mismatch/kl_k3_stale_gt0": mean_over(k3(mismatch), stale, totals.stale_tokens),
      # Largest |learner - behaviour| log-prob over tokens labelled with the
      # learner's current version: the two computed the same distribution, so
      # anything beyond the engines' rounding says the label is wrong (issue 28:
      # the free half of verifying version labels; older ones need their snapshot).
      "mismatch/abs_log_ratio_stale0_max": jnp.where(fresh > 0, jnp.abs(mismatch), 0.0).max(),
      "stale_token_frac": token_mean((staleness > 0).astype(jnp.float32)),
  }
  return LossOutput(loss, metrics)
