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

import functools

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


# The cache-free (training / prefill) attention kernel follows
# ``ModelConfig.attention_impl``: "auto" takes cuDNN's fused flash attention
# on a GPU with 16-bit activations (no float32 T x T scores in memory, the
# backward pass recomputes them) and XLA's einsum path elsewhere: on CPU (the
# exactness tests, float32) and on TPU, where a Pallas splash kernel is the
# next step (DESIGN.md, Accelerator speed).


def attention_implementation(cfg: ModelConfig) -> str:
  """The kernel ``jax.nn.dot_product_attention`` gets for ``cfg`` here."""
  impl = cfg.attention_impl
  if impl != "auto":
    return impl
  if (jax.default_backend() == "gpu" and cfg.jnp_dtype in (jnp.bfloat16, jnp.float16)
      and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128):
    return "cudnn"
  return "xla"


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None,
            impl: str) -> jax.Array:
  """Causal softmax attention. ``q[B,T,H,D]``, ``k,v[B,T,Hkv,D]``,
  ``key_mask[B,T]`` (True = real key) or None.

  ``jax.nn.dot_product_attention`` handles grouped-query heads (query head
  ``h`` reads kv head ``h // G``, Hugging Face's ``repeat_kv`` order) and
  computes the softmax in float32 on every implementation. Training and
  prefill rows are right-padded, so they need no key mask (a real query
  never sees a later key) and take the fused kernel; an explicit key mask
  (any shape of padding) takes the XLA path.
  """
  if key_mask is None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  return jax.nn.dot_product_attention(q, k, v, mask=key_mask[:, None, None, :], is_causal=True,
                                      implementation="xla")


def decode_chunk(chunk: int) -> int:
  """Cache entries one decode-attention chunk scores; ``0`` = by backend.

  On a GPU or TPU one chunk covers most bounds, so the program is straight
  line code (no loop at all, one command buffer). XLA:CPU is about 5x faster
  looping over cache-sized blocks than scoring 512+ entries at once or
  unrolling the chunks (measured on the 2-core CI machine: 5.5 vs 30-48 ms
  for 512 entries x 16 rows x 4 layers), so CPU takes 128-entry chunks.
  """
  if chunk > 0:
    return int(chunk)
  return 128 if jax.default_backend() == "cpu" else 2048


def _attend_cache_and_self(
    q: jax.Array, k: jax.Array, v: jax.Array, ck: jax.Array, cv: jax.Array,
    positions: jax.Array, rows: jax.Array | None, bound: int, chunk: int, layer: int,
) -> jax.Array:
  """One decode token attending to its row's cache entries ``j < position``
  and to its own (not yet written) key/value, reading only entries
  ``[0, bound)``.

  Same result as writing ``k, v`` at ``position`` and attending to ``j <=
  position``, without writing: the caller commits the new entries once, in
  place, instead of every layer producing an updated copy of the cache.

  ``bound`` is a Python int chosen by the host (which knows every slot's
  position) from a few length buckets, so the program has no data-dependent
  loop or branch: on a GPU a ``while`` whose trip count lives on the device
  copies its predicate to the host and waits on it every iteration, once per
  layer, and cannot be captured in a command buffer. The cost still follows
  the live lengths (a bucket, not ``max_seq_len``). The entries are scored
  in chunks of ``chunk`` with an online softmax (running max, normaliser and
  weighted sum per query head, flash-decoding style), seeded with the
  token's own key/value: straight-line code for one chunk, else a loop whose
  trip count ``ceil(bound / chunk)`` is a compile-time constant (the last
  chunk starts early, clamped, and masks the entries it repeats). Products
  take the cache's dtype with float32 accumulation; the softmax is float32.

  ``q[B,1,H,D]``, ``k, v[B,1,Hkv,D]``, ``positions[B,1]``. ``ck, cv`` are the
  whole head-major ``[L, Bc, Hkv, S, D]`` cache and ``layer`` this layer's
  index: each chunk is read in place as ``[B, Hkv, chunk, D]``, which a
  batched matmul takes without a transposed copy. ``rows[B]``: cache rows
  the ``B`` queries belong to (a gathered sub-batch of one policy version
  under DORA), read chunk by chunk instead of gathering whole rows;
  ``None`` means row ``b`` is query ``b``. A row whose position exceeds
  ``bound`` would silently lose entries: the engine checks the host's bound
  on device and reports a violation with the step's result.
  """
  b, t, h, d = q.shape
  _, bc, n_kv, s, hd = ck.shape
  bound = max(1, min(int(bound), s))
  chunk = max(1, min(int(chunk), bound))
  scale = d ** -0.5
  cdt = ck.dtype
  f32 = jnp.float32
  qg = _group(q, n_kv)[:, 0].astype(cdt)  # [B,Hkv,G,D]
  kn = k[:, 0].astype(cdt)  # [B,Hkv,D], rounded as the cache stores it
  vn = v[:, 0].astype(cdt)
  pos = positions[:, 0]  # [B]: the row's entries j < pos are in the cache
  m = jnp.einsum("bkgd,bkd->bkg", qg, kn, preferred_element_type=f32) * scale
  norm = jnp.ones_like(m)
  acc = jnp.broadcast_to(vn.astype(f32)[:, :, None, :], qg.shape)
  offsets = jnp.arange(chunk, dtype=jnp.int32)

  def visit(i, carry):
    m, norm, acc = carry
    start = jnp.minimum(i * chunk, bound - chunk)
    if rows is None:
      at, size = (layer, 0, 0, start, 0), (1, bc, n_kv, chunk, hd)
      kb = jax.lax.dynamic_slice(ck, at, size)[0]  # [B,Hkv,chunk,D]
      vb = jax.lax.dynamic_slice(cv, at, size)[0]
    else:
      idx = (start + offsets)[None, :]
      kb = ck[layer, rows[:, None], :, idx].swapaxes(1, 2)  # [B,chunk,Hkv,D] -> [B,Hkv,chunk,D]
      vb = cv[layer, rows[:, None], :, idx].swapaxes(1, 2)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, kb, preferred_element_type=f32) * scale
    idx = start + offsets
    valid = (idx[None, :] < pos[:, None]) & (idx[None, :] >= i * chunk)  # [B,chunk]
    scores = jnp.where(valid[:, None, None, :], scores, _MASK_VALUE)
    m_new = jnp.maximum(m, scores.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    norm = norm * alpha + p.sum(-1)
    acc = acc * alpha[..., None] + jnp.einsum(
        "bkgs,bksd->bkgd", p.astype(cdt), vb, preferred_element_type=f32)
    return m_new, norm, acc

  n_chunks = -(-bound // chunk)
  carry = (m, norm, acc)
  if n_chunks == 1:
    carry = visit(0, carry)
  else:  # static trip count: a scan, never a device-side predicate
    carry = jax.lax.fori_loop(0, n_chunks, visit, carry)
  _, norm, acc = carry
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
  attention_block: int = 0

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      mask: jax.Array | None,
      layer_cache: tuple[jax.Array, jax.Array] | None,
      cache_rows: jax.Array | None = None,
      layer: int = 0,
      kv_bound: int | None = None,
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
      ctx = _attend(q, k, v, mask, attention_implementation(cfg))
      if self.collect_kv:
        new_cache = (k, v)
    elif self.defer_cache_write:
      ck, cv = layer_cache  # the whole head-major [L, B, Hkv, S, D] cache, read in place
      # "dense" scores the whole cache in one chunk (the old path, kept to
      # measure against); "blocked" reads the host's bound in chunks.
      s = ck.shape[3]
      bound, chunk = (s, s) if self.decode_attention == "dense" else (
          kv_bound or s, decode_chunk(self.attention_block))
      ctx = _attend_cache_and_self(q, k, v, ck, cv, positions, cache_rows, bound, chunk, layer)
      new_cache = (k.astype(ck.dtype), v.astype(cv.dtype))
    else:
      ck, cv = layer_cache  # [B,Hkv,S,D]
      b_idx = jnp.arange(x.shape[0])[:, None]
      # Scatter at absolute positions; out-of-range positions are dropped.
      # (Advanced indices around a slice put [B,T] first: the [B,T,Hkv,D] k.)
      ck = ck.at[b_idx, :, positions].set(k.astype(ck.dtype), mode="drop")
      cv = cv.at[b_idx, :, positions].set(v.astype(cv.dtype), mode="drop")
      s = ck.shape[2]
      cache_mask = jnp.arange(s)[None, None, :] <= positions[:, :, None]  # [B,T,S]
      ctx = jax.nn.dot_product_attention(
          q, ck.swapaxes(1, 2).astype(dtype), cv.swapaxes(1, 2).astype(dtype),
          mask=cache_mask[:, None], implementation="xla")
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
  attention_block: int = 0

  @nn.compact
  def __call__(self, x, positions, mask, layer_cache, cache_rows=None, layer=0, kv_bound=None):
    h, new_cache = Attention(
        self.cfg, self.defer_cache_write, self.collect_kv, self.decode_attention,
        self.attention_block, name="attn",
    )(_rms_norm(self.cfg, "attn_norm")(x), positions, mask, layer_cache, cache_rows, layer,
      kv_bound)
    x = x + h
    x = x + MLP(self.cfg, name="mlp")(_rms_norm(self.cfg, "mlp_norm")(x))
    return x, new_cache


def head_logits(hidden: jax.Array, head: jax.Array) -> jax.Array:
  """float32 logits ``hidden[..., D] @ head[D, V]``, computed in ``hidden``'s dtype.

  The head is the largest matmul of a decode step and of the learner's
  log-prob pass (V = 151,936). Casting both operands to float32 made it a
  float32 GEMM (no bf16 tensor cores) and, on rollout servers, copied the
  whole embedding to float32 every step; here the weights take the
  activation dtype (as every other layer's do) and only the accumulation
  and the result are float32. With float32 activations (the exactness
  tests) nothing changes. Sampler and learner both call this, so they stay
  one distribution.
  """
  return jnp.einsum("...d,dv->...v", hidden, head.astype(hidden.dtype),
                    preferred_element_type=jnp.float32)


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
  attention_block: int = 0

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
      kv_bound: int | None = None,
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
      kv_bound: with ``defer_cache_write``: a Python int, every row's
        position is at most this, so decode attention reads cache entries
        ``[0, kv_bound)`` only (``None``: the whole cache). Static: one
        program per bound, no data-dependent loop (see
        ``_attend_cache_and_self``).

    Returns:
      float32 ``logits[B,T,V]`` (or the hidden states), plus the updated
      ``KVCache`` (or, with ``defer_cache_write``, the new entries) when a
      cache was passed.
    """
    cfg = self.cfg
    tokens = tokens.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    t = tokens.shape[1]

    mask = None  # key mask of the cache-free path (causality is by index)
    if kv_cache is None:
      if attention_mask is not None:
        mask = attention_mask.astype(bool)
    elif attention_mask is not None:
      # A cache has no memory of which slots were padding, so a key mask
      # here would silently not apply to later steps; refuse instead.
      raise ValueError("attention_mask is not supported with kv_cache (use right padding)")
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
                            x, positions, mask, layer_cache, cache_rows, i, kv_bound)
      if nc is not None:
        new_k.append(nc[0])
        new_v.append(nc[1])

    x = _rms_norm(cfg, "final_norm")(x)
    if return_hidden:
      out = x
    elif cfg.tie_embeddings:
      out = head_logits(x, embed.embedding.T)
    else:
      out = nn.Dense(
          cfg.vocab_size,
          use_bias=False,
          dtype=cfg.jnp_dtype,
          param_dtype=cfg.jnp_param_dtype,
          kernel_init=nn.with_logical_partitioning(
              nn.initializers.normal(stddev=0.02), ("embed", "vocab")
          ),
          # Activation-dtype operands, float32 results (see head_logits).
          dot_general=functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32),
          name="lm_head",
      )(x)

    if kv_cache is None and not collect_kv:
      return out
    return out, KVCache(k=jnp.stack(new_k), v=jnp.stack(new_v))
