"""Log-probs of target tokens: suppressed ids, temperature, and a chunked path.

Learner and rollout must compute the *same* distribution, or the importance
ratios of a perfectly on-policy batch are not 1. Both therefore go through
:func:`masked_scaled_logits`: logits divided by the sampling temperature,
with the suppressed ids (padding, BOS, special tokens that are not stop
tokens, the padded tail of an HF vocabulary) pushed to a large negative
value, so they are never sampled and carry no probability mass for the learner
either.

:func:`chunked_token_logprobs` never materialises ``[B, T, V]`` logits: it
walks the sequence in chunks of ``chunk`` positions and rematerialises each
chunk's logits in the backward pass. Peak memory for the head goes from
``O(B·T·V)`` to ``O(B·chunk·V)``; with V = 151,936 and T = 2,048 the naive
float32 logits of a single row are 1.2 GiB.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

# Finite, so that 0 * masked stays 0 (padded positions are multiplied by a
# zero mask) and log_softmax never sees an all -inf row.
SUPPRESSED_LOGIT = -1e30


def suppress_mask(vocab_size: int, suppressed_ids: Iterable[int]) -> np.ndarray | None:
  """``[vocab]`` bool, True for ids that must never be sampled; None if empty."""
  ids = sorted({int(i) for i in suppressed_ids})
  if not ids:
    return None
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"suppressed token ids {bad[:5]} outside the vocabulary of {vocab_size}")
  mask = np.zeros((vocab_size,), bool)
  mask[ids] = True
  mask.setflags(write=False)
  return mask


def masked_scaled_logits(
    logits: jax.Array, temperature: float = 1.0, mask: np.ndarray | None = None
) -> jax.Array:
  """float32 ``logits / temperature`` with suppressed ids at ``SUPPRESSED_LOGIT``."""
  out = logits.astype(jnp.float32)
  if temperature != 1.0:
    out = out / temperature
  if mask is not None:
    out = jnp.where(jnp.asarray(mask), SUPPRESSED_LOGIT, out)
  return out


def token_logprobs(
    logits: jax.Array,
    targets: jax.Array,
    temperature: float = 1.0,
    mask: np.ndarray | None = None,
) -> jax.Array:
  """``log p(targets)``: ``logits[B,T,V]``, ``targets[B,T]`` -> ``[B,T]`` float32."""
  logp = jax.nn.log_softmax(masked_scaled_logits(logits, temperature, mask), axis=-1)
  return jnp.take_along_axis(logp, targets.astype(jnp.int32)[..., None], axis=-1)[..., 0]


def chunked_token_logprobs(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    mask: np.ndarray | None = None,
    chunk: int = 0,
    softcap: float = 0.0,
) -> jax.Array:
  """``log p(targets)`` from hidden states, ``chunk`` positions at a time.

  Args:
    hidden: ``[B,T,D]`` final-normed hidden states
      (``Transformer(..., return_hidden=True)``).
    head: ``[D,V]`` LM head (``transformer.head_weight``).
    targets: ``[B,T]`` int32.
    temperature, mask: as :func:`token_logprobs`.
    chunk: positions per chunk; ``0`` or ``>= T`` computes the whole
      ``[B,T,V]`` at once (the naive path, kept for small vocabularies where
      the loop only costs time).
    softcap: the model's ``final_logit_softcap`` (Gemma 2): the same
      ``cap * tanh(logits / cap)`` the sampler's ``head_logits`` applies.

  Returns:
    ``[B,T]`` float32, equal to ``token_logprobs(hidden @ head, targets)``.
  """
  b, t, _ = hidden.shape

  def chunk_logprobs(h: jax.Array, tgt: jax.Array) -> jax.Array:
    # Activation-dtype operands, float32 accumulation and result: a float32
    # GEMM here was the learner's largest matmul without tensor cores.
    logits = jnp.einsum("btd,dv->btv", h, head.astype(h.dtype), preferred_element_type=jnp.float32)
    if softcap:
      logits = softcap * jnp.tanh(logits / softcap)
    return token_logprobs(logits, tgt, temperature, mask)

  if chunk <= 0 or chunk >= t:
    return chunk_logprobs(hidden, targets)
  n = -(-t // chunk)
  pad = n * chunk - t
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  tg = jnp.pad(targets, ((0, 0), (0, pad)))
  # [n, B, chunk, ...]: the batch axis keeps its (data-parallel) sharding.
  h = h.reshape(b, n, chunk, -1).swapaxes(0, 1)
  tg = tg.reshape(b, n, chunk).swapaxes(0, 1)
  # Remat: the backward pass recomputes one chunk's logits at a time instead
  # of keeping every chunk's [B, chunk, V] residuals alive.
  body = jax.checkpoint(lambda args: chunk_logprobs(*args))
  out = jax.lax.map(body, (h, tg))  # [n, B, chunk]
  return out.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
