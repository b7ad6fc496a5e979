"""Decoder-only transformer (Flax Linen) used by both learner and rollout.

Architecture: token embedding -> ``n_layers`` x [RMSNorm -> causal MHA with
RoPE -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head.
The LM head is *untied* from the embedding: the vocabulary is tiny, so the
extra ``d_model * vocab`` params cost nothing, and a separately (small-)
initialised head starts the policy near uniform, which keeps early GRPO
log-prob ratios well behaved.

Parameters are created through ``nn.with_logical_partitioning`` so the learner
can lay them out with ``nn.logical_to_mesh_sharding`` and
``jax_dora.learner.mesh.LOGICAL_AXIS_RULES``. Logical axis names:

  * ``"vocab"``: vocabulary dim (embedding rows, LM-head columns).
  * ``"embed"``: model / residual width ``d_model``.
  * ``"heads"``: attention heads.
  * ``"kv"``:    per-head dim ``head_dim``.
  * ``"mlp"``:   MLP hidden width ``d_ff``.
  * ``"norm"``:  RMSNorm scale vectors.

Parameter shapes (per layer ``layers_i``):
  ``embed/embedding [vocab, embed]``, ``attn/{query,key,value}/kernel
  [embed, heads, kv]``, ``attn/out/kernel [heads, kv, embed]``,
  ``mlp/{wi_0,wi_1}/kernel [embed, mlp]``, ``mlp/wo/kernel [mlp, embed]``,
  ``*_norm/scale [norm]``, ``lm_head/kernel [embed, vocab]``.
No biases: none of the layers benefit at this scale, and fewer leaves means
fewer shardings to reason about.

Params are float32; activations and the KV cache use ``cfg.dtype``; attention
softmax and logits are computed in float32.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_dora.model.config import ModelConfig
from jax_dora.model.kv_cache import KVCache

# Finite "minus infinity": a fully masked row (e.g. a padded query) then gives
# a uniform softmax instead of NaNs that would poison gradients.
_MASK_VALUE = -1e30


def _rms_norm(name: str, dtype: jnp.dtype) -> nn.RMSNorm:
  return nn.RMSNorm(
      epsilon=1e-6,
      dtype=dtype,
      param_dtype=jnp.float32,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
      name=name,
  )


def apply_rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary embedding on ``x[B,T,H,D]`` at absolute ``positions[B,T]``.

  Uses the half-split (GPT-NeoX / MaxText) layout. Computed in float32 so that
  a cached key and a freshly computed one at the same position are identical.
  """
  d = x.shape[-1]
  freq = base ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)  # [D/2]
  angle = positions.astype(jnp.float32)[..., None] * freq  # [B,T,D/2]
  sin = jnp.sin(angle)[:, :, None, :]
  cos = jnp.cos(angle)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax attention. ``q[B,T,H,D]``, ``k,v[B,S,H,D]``, ``mask[B,T,S]``."""
  scale = q.shape[-1] ** -0.5
  scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  scores = jnp.where(mask[:, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("bhts,bshd->bthd", probs, v.astype(jnp.float32)).astype(q.dtype)


class Attention(nn.Module):
  """Multi-head causal self-attention with optional KV-cache read/write."""

  cfg: ModelConfig

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      mask: jax.Array | None,
      layer_cache: tuple[jax.Array, jax.Array] | None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    cfg = self.cfg
    dtype = cfg.jnp_dtype
    init = nn.initializers.lecun_normal()

    def proj(name: str) -> jax.Array:
      return nn.DenseGeneral(
          features=(cfg.n_heads, cfg.head_dim),
          use_bias=False,
          dtype=dtype,
          param_dtype=jnp.float32,
          kernel_init=nn.with_logical_partitioning(init, ("embed", "heads", "kv")),
          name=name,
      )(x)

    q = apply_rope(proj("query"), positions, cfg.rope_base)
    k = apply_rope(proj("key"), positions, cfg.rope_base)
    v = proj("value")

    new_cache = None
    if layer_cache is None:
      ctx = _attend(q, k, v, mask)
    else:
      ck, cv = layer_cache  # [B,S,H,D]
      b_idx = jnp.arange(x.shape[0])[:, None]
      # Scatter at absolute positions; out-of-range positions are dropped.
      ck = ck.at[b_idx, positions].set(k.astype(ck.dtype), mode="drop")
      cv = cv.at[b_idx, positions].set(v.astype(cv.dtype), mode="drop")
      s = ck.shape[1]
      cache_mask = jnp.arange(s)[None, None, :] <= positions[:, :, None]  # [B,T,S]
      ctx = _attend(q, ck.astype(dtype), cv.astype(dtype), cache_mask)
      new_cache = (ck, cv)

    out = nn.DenseGeneral(
        features=cfg.d_model,
        axis=(-2, -1),
        use_bias=False,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.with_logical_partitioning(init, ("heads", "kv", "embed")),
        name="out",
    )(ctx)
    return out, new_cache


class MLP(nn.Module):
  """SwiGLU feed-forward: ``wo(silu(wi_0 x) * wi_1 x)``."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    dtype = cfg.jnp_dtype
    init = nn.initializers.lecun_normal()

    def dense(features: int, axes: tuple[str, str], name: str) -> nn.Dense:
      return nn.Dense(
          features,
          use_bias=False,
          dtype=dtype,
          param_dtype=jnp.float32,
          kernel_init=nn.with_logical_partitioning(init, axes),
          name=name,
      )

    h = nn.silu(dense(cfg.d_ff, ("embed", "mlp"), "wi_0")(x)) * dense(
        cfg.d_ff, ("embed", "mlp"), "wi_1"
    )(x)
    return dense(cfg.d_model, ("mlp", "embed"), "wo")(h)


class Block(nn.Module):
  """Pre-norm residual block."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, mask, layer_cache):
    dtype = self.cfg.jnp_dtype
    h, new_cache = Attention(self.cfg, name="attn")(
        _rms_norm("attn_norm", dtype)(x), positions, mask, layer_cache
    )
    x = x + h
    x = x + MLP(self.cfg, name="mlp")(_rms_norm("mlp_norm", dtype)(x))
    return x, new_cache


class Transformer(nn.Module):
  """Decoder-only LM. See the module docstring for layout and axis names."""

  cfg: ModelConfig

  @nn.compact
  def __call__(
      self,
      tokens: jax.Array,
      positions: jax.Array,
      kv_cache: KVCache | None = None,
      attention_mask: jax.Array | None = None,
  ) -> jax.Array | tuple[jax.Array, KVCache]:
    """Runs the model.

    Args:
      tokens: ``[B,T]`` int32 token ids.
      positions: ``[B,T]`` int32 absolute positions (drive RoPE and, with a
        cache, where k/v are written).
      kv_cache: If given, k/v for ``tokens`` are written into it at
        ``positions`` and each query attends to cache slots ``j <= position``
        of its own row. Prefill = prompt at positions ``0..T-1`` (right-padded
        slots get overwritten by decode before they are read); decode =
        ``T=1`` at per-row positions.
      attention_mask: ``[B,T]`` bool, True for real tokens; only used without
        a cache, where it hides padded *keys* (causality is by index).

    Returns:
      float32 ``logits[B,T,V]``, plus the updated ``KVCache`` when one was
      passed.
    """
    cfg = self.cfg
    dtype = cfg.jnp_dtype
    tokens = tokens.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    t = tokens.shape[1]

    if kv_cache is None:
      mask = jnp.tril(jnp.ones((t, t), bool))[None]  # [1,T,T]
      if attention_mask is not None:
        mask = mask & attention_mask.astype(bool)[:, None, :]
      mask = jnp.broadcast_to(mask, (tokens.shape[0], t, t))
    else:
      if attention_mask is not None:
        # A cache has no memory of which slots were padding, so a key mask
        # here would silently not apply to later steps; refuse instead.
        raise ValueError("attention_mask is not supported with kv_cache (use right padding)")
      mask = None

    x = nn.Embed(
        cfg.vocab_size,
        cfg.d_model,
        dtype=dtype,
        param_dtype=jnp.float32,
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), ("vocab", "embed")
        ),
        name="embed",
    )(tokens)

    new_k, new_v = [], []
    for i in range(cfg.n_layers):
      layer_cache = None if kv_cache is None else (kv_cache.k[i], kv_cache.v[i])
      x, nc = Block(cfg, name=f"layers_{i}")(x, positions, mask, layer_cache)
      if nc is not None:
        new_k.append(nc[0])
        new_v.append(nc[1])

    x = _rms_norm("final_norm", dtype)(x)
    logits = nn.Dense(
        cfg.vocab_size,
        use_bias=False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.normal(stddev=0.02), ("embed", "vocab")
        ),
        name="lm_head",
    )(x.astype(jnp.float32))

    if kv_cache is None:
      return logits
    return logits, KVCache(k=jnp.stack(new_k), v=jnp.stack(new_v))


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """``log p(targets)`` per position: ``logits[B,T,V]``, ``targets[B,T]`` -> ``[B,T]`` f32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, targets.astype(jnp.int32)[..., None], axis=-1)[..., 0]
