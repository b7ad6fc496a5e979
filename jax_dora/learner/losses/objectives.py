"""Policy-gradient objectives, chosen by ``learner.loss``.

Each is a pure function of :class:`ObjectiveInputs` returning a per-token loss
(the caller applies the correction's keep-mask and the aggregation weights).
Three log-probs meet here:

* ``logprobs``: the policy being optimised, the only differentiable input;
* ``behaviour_logprobs``: what the rollout that sampled the token reported;
* ``proximal_logprobs``: the learner's own policy at the current version
  (stop-gradient), so ``rho = pi_prox / pi_behaviour`` is the staleness and
  engine-mismatch gap and ``log_weight`` its corrected log (see
  :mod:`corrections`).

Objectives that take their ratio against the behaviour policy (``grpo``,
``gspo``, ``cispo``) swap the gap part of that ratio for its corrected value:
``log r = log pi - log pi_b + sg(log_weight - log rho)``, which is exactly
``log pi - log pi_b`` when there is no correction.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dora.learner.losses.corrections import sequence_mean
from jax_dora.learner.losses.registry import OBJECTIVES
from jax_dora.learner.losses.settings import LossSettings

sg = jax.lax.stop_gradient


class ObjectiveInputs(NamedTuple):
  logprobs: jax.Array  # [B, T]
  behaviour_logprobs: jax.Array  # [B, T]
  proximal_logprobs: jax.Array  # [B, T], stop-gradient
  log_rho: jax.Array  # [B, T] proximal - behaviour
  log_weight: jax.Array  # [B, T] corrected log_rho
  advantages: jax.Array  # [B, 1]
  mask: jax.Array  # [B, T] float


class ObjectiveOutput(NamedTuple):
  per_token: jax.Array  # [B, T] loss before masking and aggregation
  ratio: jax.Array  # [B, T] the ratio the objective clips (metrics)
  clipped_low: jax.Array  # [B, T] float: the lower bound took the gradient away
  clipped_high: jax.Array  # [B, T] float: the upper bound did


def _behaviour_log_ratio(x: ObjectiveInputs) -> jax.Array:
  return x.logprobs - x.behaviour_logprobs + sg(x.log_weight - x.log_rho)


def _ppo_clip(ratio: jax.Array, adv: jax.Array, lo: float, hi: float) -> ObjectiveOutput:
  """``-min(r A, clip(r, 1 - lo, 1 + hi) A)`` with the side whose bound is active."""
  per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - lo, 1.0 + hi) * adv)
  low = ((ratio < 1.0 - lo) & (adv < 0)).astype(jnp.float32)
  high = ((ratio > 1.0 + hi) & (adv > 0)).astype(jnp.float32)
  return ObjectiveOutput(per_token, ratio, low, high)


@OBJECTIVES.register("grpo")
def grpo(x: ObjectiveInputs, s: LossSettings) -> ObjectiveOutput:
  """PPO clipping of ``pi / pi_behaviour`` (DeepSeekMath GRPO; DAPO clip-higher)."""
  return _ppo_clip(jnp.exp(_behaviour_log_ratio(x)), x.advantages, s.clip_eps, s.clip_eps_high)


@OBJECTIVES.register("decoupled_ppo")
def decoupled_ppo(x: ObjectiveInputs, s: LossSettings) -> ObjectiveOutput:
  """AReaL's decoupled PPO: clip ``pi / pi_prox``, weight by ``pi_prox / pi_behaviour``.

  The trust region is centred on the learner's own current policy rather
  than on a stale behaviour policy, so clipping does not freeze tokens merely
  because the behaviour version is old; the (corrected) behaviour gap enters
  only as an importance weight.
  """
  out = _ppo_clip(jnp.exp(x.logprobs - x.proximal_logprobs), x.advantages,
                  s.clip_eps, s.clip_eps_high)
  return out._replace(per_token=out.per_token * sg(jnp.exp(x.log_weight)))


@OBJECTIVES.register("gspo")
def gspo(x: ObjectiveInputs, s: LossSettings) -> ObjectiveOutput:
  """GSPO (Qwen3): one length-normalised ratio per sequence, clipped per sequence.

  ``s_i = exp(mean_t log r_it)``; every token carries ``sg(s_i) * pi / sg(pi)``
  (GSPO-token), whose value is ``s_i`` and whose gradient is that of the
  sequence ratio when the loss is averaged per sequence.
  """
  seq = sg(sequence_mean(_behaviour_log_ratio(x), x.mask))
  ratio = jnp.exp(x.logprobs - sg(x.logprobs) + seq)
  return _ppo_clip(ratio, x.advantages, s.gspo_clip_eps, s.gspo_clip_eps_high)


@OBJECTIVES.register("cispo")
def cispo(x: ObjectiveInputs, s: LossSettings) -> ObjectiveOutput:
  """CISPO (MiniMax-M1): ``-sg(min(r, 1 + eps)) A log pi``.

  The importance weight is clipped and detached instead of the token being
  dropped, so every token (including the rare, high-ratio "fork" tokens of
  long reasoning) keeps a gradient.
  """
  ratio = jnp.exp(_behaviour_log_ratio(x))
  hi = 1.0 + s.cispo_clip_high
  per_token = -sg(jnp.minimum(ratio, hi)) * x.advantages * x.logprobs
  high = (ratio > hi).astype(jnp.float32)
  return ObjectiveOutput(per_token, ratio, jnp.zeros_like(high), high)


@OBJECTIVES.register("sft")
def sft(x: ObjectiveInputs, s: LossSettings) -> ObjectiveOutput:
  """Supervised fine-tuning: ``-A log pi`` of the masked tokens (``python -m jax_dora.sft``).

  With every advantage 1 and ``loss_aggregation=token_mean`` this is the
  masked next-token cross-entropy of the completion tokens, computed by the
  same learner step as RL (sharding, micro-batching, chunked log-probs). No
  ratio exists: behaviour log-probs are not read, nothing is clipped.
  """
  del s
  zeros = jnp.zeros_like(x.logprobs)
  return ObjectiveOutput(-x.advantages * x.logprobs, jnp.ones_like(x.logprobs), zeros, zeros)
