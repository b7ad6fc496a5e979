"""Token sampling for rollout, with the behaviour log-probs the learner needs.

The reported log-prob is always ``log_softmax(logits / temperature)[token]``
over the *full* vocabulary, even when top-p truncation decided which token was
drawn. The learner recomputes ``log pi(token)`` from its own forward pass at
the same temperature and without any truncation (``token_logprobs(logits /
temperature, targets)``); importance ratios ``pi_learner / pi_behaviour`` are
only meaningful if both sides are the same distribution family, so we report
the untruncated one. (With ``top_p < 1`` the drawn token then comes from a
slightly different distribution than the one reported; that bias is the usual
trade-off RL systems make, and ``top_p = 1`` -- the default -- removes it.)

Suppressed ids (``mask``: padding, BOS, special tokens that are not stop
tokens) are removed from the distribution before anything else, so they are
never sampled; the learner applies the same mask
(``jax_dora.model.logits``), which keeps both sides one distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dora.model.logits import masked_scaled_logits


def sample_tokens(
    logits: jax.Array,
    rng: jax.Array,
    temperature: float,
    top_p: float = 1.0,
    mask: np.ndarray | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row of ``logits[B, V]``.

  Args:
    logits: float logits, ``[B, V]``.
    rng: PRNG key (ignored for greedy decoding).
    temperature: Python float; ``0`` means greedy (argmax), and the reported
      log-prob is then taken at temperature 1 so it is still a proper
      log-probability rather than ``0``/``-inf``.
    top_p: Python float in ``(0, 1]``; nucleus truncation of the *sampling*
      distribution only (see module docstring).
    mask: ``[V]`` bool, ids never to sample (see module docstring).

  Returns:
    ``(tokens[B] int32, logprobs[B] float32)``.
  """
  if temperature <= 0.0:
    logits = masked_scaled_logits(logits, 1.0, mask)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]

  scaled = masked_scaled_logits(logits, temperature, mask)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  sample_logits = scaled
  if top_p < 1.0:
    # Keep the smallest prefix of the sorted distribution whose mass reaches
    # top_p; the most likely token is always kept so the set is never empty.
    sorted_logp = jnp.sort(logp, axis=-1)[:, ::-1]
    cum = jnp.cumsum(jnp.exp(sorted_logp), axis=-1)
    # Index of the first sorted token at which the cumulative mass >= top_p.
    cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_logp, cutoff_idx, axis=-1)
    sample_logits = jnp.where(logp >= cutoff, scaled, -jnp.inf)
  tokens = jax.random.categorical(rng, sample_logits, axis=-1).astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
