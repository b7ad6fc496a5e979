"""Importance-sampling corrections for the behaviour-policy gap.

The tokens were sampled by the *behaviour* policy (an older version, and on
accelerators a rollout engine whose kernels differ from the learner's). The
gap between the learner's *proximal* policy (its parameters at the current
version) and the behaviour policy is ``rho = pi_prox / pi_behaviour`` per
token. A correction maps ``log rho`` to the log-weight the objective uses in
its place, plus a keep-mask:

* ``none``: the raw ratio, unbounded.
* ``tis`` (truncated IS; slime, verl): ``min(rho, C)`` (``learner.tis_cap``),
  which bounds the variance a very unlikely behaviour token can add.
* ``mis`` (masked IS; IcePop): tokens whose ``rho`` lies outside
  ``[learner.mis_low, learner.mis_high]`` are dropped from the loss.

``learner.is_level=sequence`` judges whole sequences by the geometric mean of
their ``rho`` (length-normalised like GSPO's ratio, so a long answer is not
truncated merely for being long): ``tis`` lowers every token's log-weight by
the sequence's excess over ``log C``; ``mis`` drops whole sequences.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dora.learner.losses.registry import CORRECTIONS
from jax_dora.learner.losses.settings import LossSettings


class Correction(NamedTuple):
  log_weight: jax.Array  # [B, T] the corrected log(pi_prox / pi_behaviour)
  keep: jax.Array  # [B, T] float 0/1: tokens that stay in the loss
  affected: jax.Array  # [B, T] float 0/1: tokens truncated or masked (metrics)


def sequence_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """``[B, 1]`` masked mean over each row (0 for a row without tokens)."""
  return ((x * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0))[:, None]


def _log(x: float) -> float:
  return math.inf if x == math.inf else (-math.inf if x <= 0 else math.log(x))


@CORRECTIONS.register("none")
def no_correction(log_rho: jax.Array, mask: jax.Array, s: LossSettings) -> Correction:
  del s
  ones = jnp.ones_like(mask)
  return Correction(log_rho, ones, jnp.zeros_like(mask))


@CORRECTIONS.register("tis")
def truncated_is(log_rho: jax.Array, mask: jax.Array, s: LossSettings) -> Correction:
  cap = _log(s.tis_cap)
  if s.correction_level == "sequence":
    excess = jnp.maximum(sequence_mean(log_rho, mask) - cap, 0.0)
    log_w = log_rho - excess
    affected = jnp.broadcast_to(excess > 0, log_rho.shape)
  else:
    # min(log rho, +inf) is log rho bit for bit: C = inf is no correction.
    log_w = jnp.minimum(log_rho, cap)
    affected = log_rho > cap
  return Correction(log_w, jnp.ones_like(mask), affected.astype(jnp.float32) * mask)


@CORRECTIONS.register("mis")
def masked_is(log_rho: jax.Array, mask: jax.Array, s: LossSettings) -> Correction:
  lo, hi = _log(s.mis_low), _log(s.mis_high)
  judged = sequence_mean(log_rho, mask) if s.correction_level == "sequence" else log_rho
  keep = jnp.broadcast_to((judged >= lo) & (judged <= hi), log_rho.shape).astype(jnp.float32)
  return Correction(log_rho, keep, (1.0 - keep) * mask)
