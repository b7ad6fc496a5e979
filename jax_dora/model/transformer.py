"""Decoder-only transformer (Flax Linen) used by both learner and rollout.

One module covers the tiny native model and the Llama 3 (3.1/3.2), Qwen2.5
and Qwen3 families; ``ModelConfig`` switches the differences:

  embedding -> ``n_layers`` x [RMSNorm -> causal GQA attention (optional
  q/k/v bias, optional per-head q/k RMSNorm, RoPE with optional Llama-3
  scaling) -> residual, RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm ->
  LM head (untied, or the transposed embedding).

Parameters are created through ``nn.with_logical_partitioning`` so the learner
can lay them out with ``nn.logical_to_mesh_sharding`` and
``jax_dora.learner.mesh.LOGICAL_AXIS_RULES``. Logical axis names:

  * ``"vocab"``: vocabulary dim (embedding rows, LM-head columns).
  * ``"embed"``: model / residual width ``d_model``.
  * ``"heads"``: query heads.
  * ``"kv_heads"``: key/value heads (``n_kv_heads``).
  * ``"kv"``:    per-head dim ``head_dim``.
  * ``"mlp"``:   MLP hidden width ``d_ff``.
  * ``"norm"``:  RMSNorm scale vectors.

Parameter shapes (per layer ``layers_i``):
  ``embed/embedding [vocab, embed]``, ``attn/query/kernel [embed, heads, kv]``,
  ``attn/{key,value}/kernel [embed, kv_heads, kv]`` (+ ``bias [.., kv]`` with
  ``qkv_bias``), ``attn/out/kernel [heads, kv, embed]``,
  ``attn/{query,key}_norm/scale [kv]`` (``qk_norm``),
  ``mlp/{wi_0,wi_1}/kernel [embed, mlp]``, ``mlp/wo/kernel [mlp, embed]``,
  ``*_norm/scale [norm]``, ``lm_head/kernel [embed, vocab]`` (untied only).
``jax_dora.model.families`` maps these to and from Hugging Face names.

Params use ``cfg.param_dtype``; activations and the KV cache ``cfg.dtype``;
attention softmax and logits are float32.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_dora.model.config import ModelConfig
from jax_dora.model.kv_cache import KVCache
from jax_dora.model.rope import apply_rope

# Finite "minus infinity": a fully masked row (e.g. a padded query) then gives
# a uniform softmax instead of NaNs that would poison gradients.
_MASK_VALUE = -1e30

# learner.remat -> what a rematerialised block may keep for the backward pass.
REMAT_POLICIES = {
    "none": None,  # no remat at all
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _rms_norm(cfg: ModelConfig, name: str, axis_name: str = "norm") -> nn.RMSNorm:
  return nn.RMSNorm(
      epsilon=cfg.norm_eps,
      dtype=cfg.jnp_dtype,
      param_dtype=cfg.jnp_param_dtype,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, (axis_name,)),
      name=name,
  )


def _group(q: jax.Array, n_kv: int) -> jax.Array:
  """``[B,T,H,D]`` queries -> ``[B,T,Hkv,G,D]``: query head ``h`` reads kv head ``h // G``
  (Hugging Face's ``repeat_kv`` order)."""
  b, t, h, d = q.shape
  return q.reshape(b, t, n_kv, h // n_kv, d)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax attention. ``q[B,T,H,D]``, ``k,v[B,S,Hkv,D]``, ``mask[B,T,S]``."""
  b, t, h, d = q.shape
  scale = d ** -0.5
  qg = _group(q.astype(jnp.float32), k.shape[2])
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * scale
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  ctx = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
  return ctx.reshape(b, t, h, d).astype(q.dtype)


def _attend_cache_and_self(
    q: jax.Array, k: jax.Array, v: jax.Array, ck: jax.Array, cv: jax.Array, positions: jax.Array
) -> jax.Array:
  """One decode token attending to its row's cache entries ``j < position``
  and to its own (not yet written) key/value.

  Same result as writing ``k, v`` at ``position`` and attending to ``j <=
  position``, without writing: the caller commits the new entries once,
  in place, instead of every layer producing an updated copy of the cache.
  ``q[B,1,H,D]``, ``k, v[B,1,Hkv,D]``, ``ck, cv[B,S,Hkv,D]``, ``positions[B,1]``.
  """
  b, t, h, d = q.shape
  scale = d ** -0.5
  qg = _group(q.astype(jnp.float32), ck.shape[2])  # [B,1,Hkv,G,D]
  # Round the new entry exactly as the cache would store it.
  kf = k.astype(ck.dtype).astype(jnp.float32)
  vf = v.astype(cv.dtype).astype(jnp.float32)
  cached = jnp.einsum("btkgd,bskd->bkgts", qg, ck.astype(jnp.float32)) * scale  # [B,Hkv,G,1,S]
  seen = jnp.arange(ck.shape[1])[None, None, :] < positions[:, :, None]  # [B,1,S]
  cached = jnp.where(seen[:, None, None, :, :], cached, _MASK_VALUE)
  own = jnp.einsum("btkgd,btkd->bkgt", qg, kf)[..., None] * scale  # [B,Hkv,G,1,1]
  probs = jax.nn.softmax(jnp.concatenate([cached, own], axis=-1), axis=-1)
  ctx = jnp.einsum("bkgts,bskd->btkgd", probs[..., :-1], cv.astype(jnp.float32))
  ctx = ctx + jnp.einsum("bkgt,btkd->btkgd", probs[..., -1], vf)
  return ctx.reshape(b, t, h, d).astype(q.dtype)


def _attend_cache_and_self_blocked(
    q: jax.Array, k: jax.Array, v: jax.Array, ck: jax.Array, cv: jax.Array,
    positions: jax.Array, rows: jax.Array | None, block: int, layer: int,
) -> jax.Array:
  """:func:`_attend_cache_and_self` reading only the cache blocks below the
  longest live row (flash-decoding style online softmax).

  The dense version scores every one of ``max_seq_len`` cache entries per
  step, so a decode step costs the cache size, not what was generated; for
  reasoning traces served from an 8k-32k cache that is most of the step.
  Here a ``while`` loop visits blocks ``0 .. ceil(max(positions) / block)``
  only, keeping a running max / normaliser / weighted sum per query head, so
  the cost follows the live lengths. The row's own new key/value seeds the
  running state (it is not in the cache yet, see ``defer_cache_write``).

  ``rows[B]``: cache rows the ``B`` queries belong to (a gathered sub-batch of
  one policy version under DORA), read block by block instead of gathering
  whole rows; ``None`` means row ``b`` is query ``b``. This XLA path runs on
  every backend; the gathers and the loop bound are dynamic, so one compile
  serves every length.

  ``ck, cv`` are the whole ``[L, B, S, Hkv, D]`` cache and ``layer`` this
  layer's index: slicing a layer out before the loop would materialise a
  copy of that layer's cache every step (the loop needs its operand as a
  buffer), which costs what the blocks save.
  """
  b, t, h, d = q.shape
  _, bc, s, n_kv, hd = ck.shape
  block = max(1, min(int(block), s))
  scale = d ** -0.5
  qg = _group(q.astype(jnp.float32), n_kv)[:, 0]  # [B,Hkv,G,D]
  kf = k.astype(ck.dtype).astype(jnp.float32)[:, 0]  # [B,Hkv,D], rounded as the cache stores it
  vf = v.astype(cv.dtype).astype(jnp.float32)[:, 0]
  pos = positions[:, 0]  # [B]: the row's entries j < pos are in the cache
  m = jnp.einsum("bkgd,bkd->bkg", qg, kf) * scale
  norm = jnp.ones_like(m)
  acc = jnp.broadcast_to(vf[:, :, None, :], qg.shape)
  n_blocks = (jnp.max(pos) + block - 1) // block
  offsets = jnp.arange(block, dtype=jnp.int32)

  def visit(i, carry):
    m, norm, acc = carry
    # The last block may start early (clamped) so it never runs off the
    # cache; the ``>= i * block`` test keeps overlapped entries counted once.
    start = jnp.minimum(i * block, s - block)
    idx = start + offsets
    if rows is None:
      at, size = (layer, 0, start, 0, 0), (1, bc, block, n_kv, hd)
      kb = jax.lax.dynamic_slice(ck, at, size)[0]
      vb = jax.lax.dynamic_slice(cv, at, size)[0]
    else:
      kb, vb = ck[layer, rows[:, None], idx[None, :]], cv[layer, rows[:, None], idx[None, :]]
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, kb.astype(jnp.float32)) * scale
    valid = (idx[None, :] < pos[:, None]) & (idx[None, :] >= i * block)  # [B,block]
    scores = jnp.where(valid[:, None, None, :], scores, _MASK_VALUE)
    m_new = jnp.maximum(m, scores.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    norm = norm * alpha + p.sum(-1)
    acc = acc * alpha[..., None] + jnp.einsum("bkgs,bskd->bkgd", p, vb.astype(jnp.float32))
    return m_new, norm, acc

  m, norm, acc = jax.lax.fori_loop(0, n_blocks, visit, (m, norm, acc))
  ctx = acc / norm[..., None]
  return ctx.reshape(b, t, h, d).astype(q.dtype)


# Decode attention implementations (``rollout.decode_attention``).
DECODE_ATTENTION = ("blocked", "dense")


class Attention(nn.Module):
  """Grouped-query causal self-attention with optional KV-cache read/write."""

  cfg: ModelConfig
  # Decode only: return the new k/v instead of an updated cache (see
  # Transformer.__call__'s ``defer_cache_write``).
  defer_cache_write: bool = False
  # Without a cache: also return this call's k/v (batched prefill).
  collect_kv: bool = False
  decode_attention: str = "blocked"
  attention_block: int = 128

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      mask: jax.Array | None,
      layer_cache: tuple[jax.Array, jax.Array] | None,
      cache_rows: jax.Array | None = None,
      layer: int = 0,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    cfg = self.cfg
    dtype = cfg.jnp_dtype
    init = nn.initializers.lecun_normal()

    def proj(name: str, heads: int, heads_axis: str) -> jax.Array:
      return nn.DenseGeneral(
          features=(heads, cfg.head_dim),
          use_bias=cfg.qkv_bias,
          dtype=dtype,
          param_dtype=cfg.jnp_param_dtype,
          kernel_init=nn.with_logical_partitioning(init, ("embed", heads_axis, "kv")),
          bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (heads_axis, "kv")),
          name=name,
      )(x)

    q = proj("query", cfg.n_heads, "heads")
    k = proj("key", cfg.n_kv_heads, "kv_heads")
    v = proj("value", cfg.n_kv_heads, "kv_heads")
    if cfg.qk_norm:
      q = _rms_norm(cfg, "query_norm", "kv")(q)
      k = _rms_norm(cfg, "key_norm", "kv")(k)
    q = apply_rope(q, positions, cfg)
    k = apply_rope(k, positions, cfg)

    new_cache = None
    if layer_cache is None:
      ctx = _attend(q, k, v, mask)
      if self.collect_kv:
        new_cache = (k, v)
    elif self.defer_cache_write:
      ck, cv = layer_cache  # the whole [L, B, S, Hkv, D] cache: see the blocked path
      if self.decode_attention == "blocked":
        ctx = _attend_cache_and_self_blocked(q, k, v, ck, cv, positions, cache_rows,
                                             self.attention_block, layer)
      else:
        ck, cv = ck[layer], cv[layer]
        if cache_rows is not None:  # whole rows gathered: the cost the blocked path avoids
          ck, cv = ck[cache_rows], cv[cache_rows]
        ctx = _attend_cache_and_self(q, k, v, ck, cv, positions)
      new_cache = (k.astype(ck.dtype), v.astype(cv.dtype))
    else:
      ck, cv = layer_cache  # [B,S,Hkv,D]
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
        use_bias=cfg.out_bias,
        dtype=dtype,
        param_dtype=cfg.jnp_param_dtype,
        kernel_init=nn.with_logical_partitioning(init, ("heads", "kv", "embed")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        name="out",
    )(ctx)
    return out, new_cache


class MLP(nn.Module):
  """SwiGLU feed-forward: ``wo(silu(wi_0 x) * wi_1 x)``."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    init = nn.initializers.lecun_normal()

    def dense(features: int, axes: tuple[str, str], name: str) -> nn.Dense:
      return nn.Dense(
          features,
          use_bias=False,
          dtype=cfg.jnp_dtype,
          param_dtype=cfg.jnp_param_dtype,
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
  collect_kv: bool = False
  decode_attention: str = "blocked"
  attention_block: int = 128

  @nn.compact
  def __call__(self, x, positions, mask, layer_cache, cache_rows=None, layer=0):
    h, new_cache = Attention(
        self.cfg, self.defer_cache_write, self.collect_kv, self.decode_attention,
        self.attention_block, name="attn",
    )(_rms_norm(self.cfg, "attn_norm")(x), positions, mask, layer_cache, cache_rows, layer)
    x = x + h
    x = x + MLP(self.cfg, name="mlp")(_rms_norm(self.cfg, "mlp_norm")(x))
    return x, new_cache


def head_weight(cfg: ModelConfig, params) -> jax.Array:
  """The LM head as ``[d_model, vocab]`` (the transposed embedding when tied)."""
  if cfg.tie_embeddings:
    return params["embed"]["embedding"].T
  return params["lm_head"]["kernel"]


class Transformer(nn.Module):
  """Decoder-only LM. See the module docstring for layout and axis names.

  ``remat``: a key of ``REMAT_POLICIES``; rematerialises each block in the
  backward pass (training only; the learner sets it, rollout never does).
  """

  cfg: ModelConfig
  remat: str = "none"
  # Rollout only: how a decode token reads the cache (``DECODE_ATTENTION``)
  # and the block size of the blocked path.
  decode_attention: str = "blocked"
  attention_block: int = 128

  @nn.compact
  def __call__(
      self,
      tokens: jax.Array,
      positions: jax.Array,
      kv_cache: KVCache | None = None,
      attention_mask: jax.Array | None = None,
      defer_cache_write: bool = False,
      return_hidden: bool = False,
      cache_rows: jax.Array | None = None,
      collect_kv: bool = False,
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
        the returned ``KVCache`` holds just the new entries ``[L,B,1,Hkv,D]``
        for the caller to commit (``KVCache.write_step``). Writing the cache
        inside the model produces an updated copy of the whole cache per
        call, which dominates a decode step; committing once, in place, and
        only for the rows the caller keeps (DORA runs one pass per policy
        version and keeps each row's own version) costs a few entries.
      return_hidden: Return the final-normed hidden states ``[B,T,D]``
        instead of logits. With a 150k vocabulary ``[B,T,V]`` float32 logits
        are the largest tensor of a step: the learner computes log-probs
        from the hidden states in chunks (``jax_dora.model.logits``) and
        prefill only needs the last position.
      cache_rows: with ``defer_cache_write``: ``[B]`` rows of ``kv_cache``
        the ``B`` tokens belong to (the cache keeps every slot; a DORA pass
        decodes one version's rows). Without it row ``b`` is token ``b``.
      collect_kv: without a cache: also return this call's keys/values
        ``[L,B,T,Hkv,D]`` (prefill computes attention within the prompt and
        the engine writes only these entries into the slots' cache).

    Returns:
      float32 ``logits[B,T,V]`` (or the hidden states), plus the updated
      ``KVCache`` (or, with ``defer_cache_write``, the new entries) when a
      cache was passed.
    """
    cfg = self.cfg
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
    if cache_rows is not None and not defer_cache_write:
      raise ValueError("cache_rows is only supported with defer_cache_write (decode)")
    if collect_kv and kv_cache is not None:
      raise ValueError("collect_kv is for cache-free prefill; with a cache the entries are written")
    if self.decode_attention not in DECODE_ATTENTION:
      raise ValueError(f"decode_attention={self.decode_attention!r} is not one of {DECODE_ATTENTION}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r} is not one of {sorted(REMAT_POLICIES)}")

    embed = nn.Embed(
        cfg.vocab_size,
        cfg.d_model,
        dtype=cfg.jnp_dtype,
        param_dtype=cfg.jnp_param_dtype,
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), ("vocab", "embed")
        ),
        name="embed",
    )
    x = embed(tokens)

    block_cls = Block
    if self.remat != "none":
      block_cls = nn.remat(Block, policy=REMAT_POLICIES[self.remat], prevent_cse=True)
    new_k, new_v = [], []
    for i in range(cfg.n_layers):
      if kv_cache is None:
        layer_cache = None
      elif defer_cache_write:  # decode reads the layer from the whole cache
        layer_cache = (kv_cache.k, kv_cache.v)
      else:
        layer_cache = (kv_cache.k[i], kv_cache.v[i])
      x, nc = block_cls(cfg, defer_cache_write, collect_kv, self.decode_attention,
                        self.attention_block, name=f"layers_{i}")(
                            x, positions, mask, layer_cache, cache_rows, i)
      if nc is not None:
        new_k.append(nc[0])
        new_v.append(nc[1])

    x = _rms_norm(cfg, "final_norm")(x)
    if return_hidden:
      out = x
    elif cfg.tie_embeddings:
      out = jnp.einsum("btd,vd->btv", x.astype(jnp.float32), embed.embedding.astype(jnp.float32))
    else:
      out = nn.Dense(
          cfg.vocab_size,
          use_bias=False,
          dtype=jnp.float32,
          param_dtype=cfg.jnp_param_dtype,
          kernel_init=nn.with_logical_partitioning(
              nn.initializers.normal(stddev=0.02), ("embed", "vocab")
          ),
          name="lm_head",
      )(x.astype(jnp.float32))

    if kv_cache is None and not collect_kv:
      return out
    return out, KVCache(k=jnp.stack(new_k), v=jnp.stack(new_v))
