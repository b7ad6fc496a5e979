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


def _attend_cache_and_self(
    q: jax.Array, k: jax.Array, v: jax.Array, ck: jax.Array, cv: jax.Array, positions: jax.Array
) -> jax.Array:
  """One decode token attending to its row's cache entries ``j < position``
  and to its own (not yet written) key/value.

  Same result as writing ``k, v`` at ``position`` and attending to ``j <=
  position``, without writing: the caller commits the new entries once,
  in place, instead of every layer producing an updated copy of the cache.
  ``q, k, v[B,1,H,D]``, ``ck, cv[B,S,H,D]``, ``positions[B,1]``.
  """
  scale = q.shape[-1] ** -0.5
  qf = q.astype(jnp.float32)
  # Round the new entry exactly as the cache would store it.
  kf = k.astype(ck.dtype).astype(jnp.float32)
  vf = v.astype(cv.dtype).astype(jnp.float32)
  cached = jnp.einsum("bthd,bshd->bhts", qf, ck.astype(jnp.float32)) * scale  # [B,H,1,S]
  seen = jnp.arange(ck.shape[1])[None, None, :] < positions[:, :, None]  # [B,1,S]
  cached = jnp.where(seen[:, None, :, :], cached, _MASK_VALUE)
  own = jnp.einsum("bthd,bthd->bht", qf, kf)[..., None] * scale  # [B,H,1,1]
  probs = jax.nn.softmax(jnp.concatenate([cached, own], axis=-1), axis=-1)
  ctx = jnp.einsum("bhts,bshd->bthd", probs[..., :-1], cv.astype(jnp.float32))
  ctx = ctx + jnp.einsum("bht,bthd->bthd", probs[..., -1], vf)
  return ctx.astype(q.dtype)


class Attention(nn.Module):
  """Multi-head causal self-attention with optional KV-cache read/write."""

  cfg: ModelConfig
  # Decode only: return the new k/v instead of an updated cache (see
  # Transformer.__call__'s ``defer_cache_write``).
  defer_cache_write: bool = False

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
    elif self.defer_cache_write:
      ck, cv = layer_cache
      ctx = _attend_cache_and_self(q, k, v, ck, cv, positions)
      new_cache = (k.astype(ck.dtype), v.astype(cv.dtype))
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
  defer_cache_write: bool = False

  @nn.compact
  def __call__(self, x, positions, mask, layer_cache):
    dtype = self.cfg.jnp_dtype
    h, new_cache = Attention(self.cfg, self.defer_cache_write, name="attn")(
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
      defer_cache_write: bool = False,
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
      defer_cache_write: decode (``T=1``) only. The cache is only read: each
        token attends to its row's entries ``j < position`` plus itself, and
        the returned ``KVCache`` holds just the new entries ``[L,B,1,H,D]``
        for the caller to commit (``KVCache.write_step``). Writing the cache
        inside the model produces an updated copy of the whole cache per
        call, which dominates a decode step; committing once, in place, and
        only for the rows the caller keeps (DORA runs one pass per policy
        version and keeps each row's own version) costs a few entries.

    Returns:
      float32 ``logits[B,T,V]``, plus the updated ``KVCache`` (or, with
      ``defer_cache_write``, the new entries) when a cache was passed.
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
    if defer_cache_write and (kv_cache is None or t != 1):
      raise ValueError("defer_cache_write needs a kv_cache and one token per row (decode)")

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
      x, nc = Block(cfg, defer_cache_write, name=f"layers_{i}")(x, positions, mask, layer_cache)
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
