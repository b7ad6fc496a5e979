"""Decoder-only transformer (Flax Linen) used by both learner and rollout.

One module covers the tiny native model and the Llama 3 (3.1/3.2), Qwen2.5,
Qwen3 (MoE) and Gemma 2/3 families; ``ModelConfig`` switches the differences:

  embedding (x sqrt(d_model) for Gemma) -> ``n_layers`` x [RMSNorm -> causal
  GQA attention (optional q/k/v bias, optional per-head q/k RMSNorm, RoPE
  with optional Llama-3 / linear scaling, optional score soft-capping, a
  sliding window on local layers) -> (Gemma: RMSNorm) -> residual, RMSNorm
  -> gated MLP (SwiGLU / GeGLU) or MoE -> (Gemma: RMSNorm) -> residual] ->
  RMSNorm -> LM head (untied, or the transposed embedding; optional logit
  soft-capping).

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
  ``*_norm/scale [norm]`` (``post_attn_norm``, ``post_mlp_norm`` with
  ``post_norms``), ``lm_head/kernel [embed, vocab]`` (untied only).
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
from jax_dora.model.mlp import MLP
from jax_dora.model.moe import MoE
from jax_dora.model.rope import apply_rope
from jax_dora.model.routing import ROUTING

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


class OffsetRMSNorm(nn.Module):
  """Gemma's RMSNorm: ``x / rms(x) * (offset + scale)``, all in float32, then cast back.

  Gemma checkpoints store ``w`` with the norm multiplying by ``1 + w`` (zero
  init); computing the product in float32 and casting once (Hugging Face's
  ``Gemma2RMSNorm``) matters in bfloat16, where ``1 + w`` would round.
  """

  cfg: ModelConfig
  axis_name: str = "norm"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.zeros, (self.axis_name,)),
                       (x.shape[-1],), self.cfg.jnp_param_dtype)
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.cfg.norm_eps)
    return (y * (self.cfg.norm_scale_offset + scale.astype(jnp.float32))).astype(x.dtype)


def _rms_norm(cfg: ModelConfig, name: str, axis_name: str = "norm") -> nn.Module:
  if cfg.norm_scale_offset:
    return OffsetRMSNorm(cfg, axis_name, name=name)
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


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
  """``cap * tanh(x / cap)`` (Gemma 2's attention and logit soft-capping); ``cap=0``: ``x``."""
  return x if not cap else cap * jnp.tanh(x / cap)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None,
            impl: str, cfg: ModelConfig, window: int = 0) -> jax.Array:
  """Causal softmax attention. ``q[B,T,H,D]``, ``k,v[B,T,Hkv,D]``,
  ``key_mask[B,T]`` (True = real key) or None; ``window > 0``: query ``i``
  sees keys ``j > i - window`` only (a local layer).

  ``jax.nn.dot_product_attention`` handles grouped-query heads (query head
  ``h`` reads kv head ``h // G``, Hugging Face's ``repeat_kv`` order), the
  window and the scale, and computes the softmax in float32 on every
  implementation. Training and prefill rows are right-padded, so they need
  no key mask (a real query never sees a later key) and take the fused
  kernel; an explicit key mask (any shape of padding) takes the XLA path.
  Soft-capped scores (Gemma 2) are not a fused kernel's option: they take
  :func:`_attend_softcapped`.
  """
  if cfg.attn_logit_softcap:
    return _attend_softcapped(q, k, v, key_mask, cfg, window)
  local = (window - 1, 0) if window else None
  if key_mask is None:
    return jax.nn.dot_product_attention(q, k, v, scale=cfg.attention_scale, is_causal=True,
                                        local_window_size=local, implementation=impl)
  return jax.nn.dot_product_attention(q, k, v, mask=key_mask[:, None, None, :], is_causal=True,
                                      scale=cfg.attention_scale, local_window_size=local,
                                      implementation="xla")


def _attend_softcapped(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array | None,
                       cfg: ModelConfig, window: int) -> jax.Array:
  """:func:`_attend` with ``soft_cap`` on the scaled scores (before the mask), in XLA einsums."""
  b, t, h, d = q.shape
  f32 = jnp.float32
  qg = _group(q, k.shape[2])  # [B,T,Hkv,G,D]
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=f32) * cfg.attention_scale
  s = soft_cap(s, cfg.attn_logit_softcap)
  i = jnp.arange(t)[:, None]
  j = jnp.arange(k.shape[1])[None, :]
  allowed = (j <= i) & ((i - j < window) if window else True)  # [T,S]
  allowed = allowed[None, None, None]
  if key_mask is not None:
    allowed = allowed & key_mask[:, None, None, None, :]
  p = jax.nn.softmax(jnp.where(allowed, s, _MASK_VALUE), axis=-1)
  ctx = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=f32)
  return ctx.reshape(b, t, h, d).astype(q.dtype)


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
    scale: float, softcap: float = 0.0, window: int = 0,
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

  ``scale`` multiplies the scores (then ``soft_cap(., softcap)``). A local
  layer (``window > 0``) sees only entries ``j > position - window``: when
  the window is shorter than ``bound`` the chunks start at each row's
  ``position - window + 1`` (gathered per row) and only ``ceil((window - 1)
  / chunk)`` of them are read, so a local layer's decode costs its window,
  not the context (the cache still holds every position: DESIGN.md,
  Sliding-window attention).
  """
  b, t, h, d = q.shape
  _, bc, n_kv, s, hd = ck.shape
  bound = max(1, min(int(bound), s))
  chunk = max(1, min(int(chunk), bound))
  cdt = ck.dtype
  f32 = jnp.float32
  qg = _group(q, n_kv)[:, 0].astype(cdt)  # [B,Hkv,G,D]
  kn = k[:, 0].astype(cdt)  # [B,Hkv,D], rounded as the cache stores it
  vn = v[:, 0].astype(cdt)
  pos = positions[:, 0]  # [B]: the row's entries j < pos are in the cache
  m = soft_cap(jnp.einsum("bkgd,bkd->bkg", qg, kn, preferred_element_type=f32) * scale, softcap)
  norm = jnp.ones_like(m)
  acc = jnp.broadcast_to(vn.astype(f32)[:, :, None, :], qg.shape)
  span = window - 1 if window else 0  # cache entries a local layer's token reads
  windowed = 0 < window and span < bound
  if windowed:
    chunk = max(1, min(chunk, span))
  offsets = jnp.arange(chunk, dtype=jnp.int32)
  lo = jnp.maximum(pos - span, 0)  # [B]: a local row's first visible entry

  def visit(i, carry):
    m, norm, acc = carry
    if windowed:  # per-row chunks over [pos - window + 1, pos), clamped to the cache
      idx_b = lo[:, None] + i * chunk + offsets[None, :]  # [B,chunk]
      at_rows = jnp.arange(b) if rows is None else rows
      take = jnp.minimum(idx_b, s - 1)
      kb = ck[layer, at_rows[:, None], :, take].swapaxes(1, 2)  # [B,Hkv,chunk,D]
      vb = cv[layer, at_rows[:, None], :, take].swapaxes(1, 2)
      valid = idx_b < pos[:, None]
      return update(m, norm, acc, kb, vb, valid)
    start = jnp.minimum(i * chunk, bound - chunk)
    if rows is None:
      at, size = (layer, 0, 0, start, 0), (1, bc, n_kv, chunk, hd)
      kb = jax.lax.dynamic_slice(ck, at, size)[0]  # [B,Hkv,chunk,D]
      vb = jax.lax.dynamic_slice(cv, at, size)[0]
    else:
      idx = (start + offsets)[None, :]
      kb = ck[layer, rows[:, None], :, idx].swapaxes(1, 2)  # [B,chunk,Hkv,D] -> [B,Hkv,chunk,D]
      vb = cv[layer, rows[:, None], :, idx].swapaxes(1, 2)
    idx = start + offsets
    valid = (idx[None, :] < pos[:, None]) & (idx[None, :] >= i * chunk)  # [B,chunk]
    if window:
      valid = valid & (idx[None, :] > pos[:, None] - window)
    return update(m, norm, acc, kb, vb, valid)

  def update(m, norm, acc, kb, vb, valid):
    """One chunk of keys/values ``[B,Hkv,chunk,D]`` folded into the online softmax."""
    scores = soft_cap(
        jnp.einsum("bkgd,bksd->bkgs", qg, kb, preferred_element_type=f32) * scale, softcap)
    scores = jnp.where(valid[:, None, None, :], scores, _MASK_VALUE)
    m_new = jnp.maximum(m, scores.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    norm = norm * alpha + p.sum(-1)
    acc = acc * alpha[..., None] + jnp.einsum(
        "bkgs,bksd->bkgd", p.astype(cdt), vb, preferred_element_type=f32)
    return m_new, norm, acc

  n_chunks = -(-span // chunk) if windowed else -(-bound // chunk)
  carry = (m, norm, acc)
  if n_chunks == 0:  # window 1: a token sees only itself
    pass
  elif n_chunks == 1:
    carry = visit(0, carry)
  else:  # static trip count: a scan, never a device-side predicate
    carry = jax.lax.fori_loop(0, n_chunks, visit, carry)
  _, norm, acc = carry
  ctx = acc / norm[..., None]
  return ctx.reshape(b, t, h, d).astype(q.dtype)


def _attend_cache_then_chunk(
    q: jax.Array, k: jax.Array, v: jax.Array, ck: jax.Array, cv: jax.Array,
    positions: jax.Array, rows: jax.Array, bound: int, layer: int,
    scale: float, softcap: float = 0.0, window: int = 0,
) -> jax.Array:
  """A chunk of ``T`` new tokens per row continuing a context already in the cache.

  Token ``t`` of row ``b`` (at ``positions[b, t] = start_b + t``) attends to
  the row's cache entries ``j < start_b`` and causally to the chunk's tokens
  ``<= t``: the attention of a full forward over context + chunk, with the
  context's keys/values read from the cache instead of recomputed. This is
  how a multi-turn trajectory's next turn prefills only its new tokens (the
  tool's observation) on top of the turn before, kept in the cache
  (``rollout/held_kv.py``). The cache is only read; the caller writes the
  chunk's entries.

  ``q[B,T,H,D]``, ``k, v[B,T,Hkv,D]``; ``ck, cv``: the whole head-major
  ``[L, Bc, Hkv, S, D]`` cache, ``rows[B]`` the cache rows, ``bound`` a
  static Python int ``>= max(start_b)`` (entries ``[0, bound)`` are read,
  gathered whole: a turn boundary is rare next to decode steps). Products
  take the cache's dtype with float32 accumulation; the softmax is float32.
  ``scale``, ``softcap`` and a local layer's ``window`` as in
  :func:`_attend_cache_and_self`.
  """
  b, t, h, d = q.shape
  n_kv, s = ck.shape[2], ck.shape[3]
  bound = max(1, min(int(bound), s))
  cdt = ck.dtype
  f32 = jnp.float32
  qg = _group(q, n_kv).astype(cdt)  # [B,T,Hkv,G,D]
  kc = ck[layer, rows, :, :bound]  # [B,Hkv,bound,D]
  vc = cv[layer, rows, :, :bound]
  kn, vn = k.astype(cdt), v.astype(cdt)  # [B,T,Hkv,D]
  start = positions[:, 0]  # [B]
  s_cache = soft_cap(
      jnp.einsum("btkgd,bksd->bkgts", qg, kc, preferred_element_type=f32) * scale, softcap)
  j = jnp.arange(bound, dtype=jnp.int32)
  cached = (j[None, None, :] < start[:, None, None])  # [B,1,bound]
  if window:  # token t (at positions[b, t]) sees entries j > position - window
    cached = cached & (j[None, None, :] > positions[:, :, None] - window)  # [B,T,bound]
  s_cache = jnp.where(cached[:, None, None], s_cache, _MASK_VALUE)
  s_self = soft_cap(
      jnp.einsum("btkgd,bukd->bkgtu", qg, kn, preferred_element_type=f32) * scale, softcap)
  ti, ui = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  causal = (ui <= ti) & ((ti - ui < window) if window else True)
  s_self = jnp.where(causal[None, None, None], s_self, _MASK_VALUE)
  p = jax.nn.softmax(jnp.concatenate([s_cache, s_self], axis=-1), axis=-1)
  ctx = (jnp.einsum("bkgts,bksd->btkgd", p[..., :bound].astype(cdt), vc,
                    preferred_element_type=f32)
         + jnp.einsum("bkgtu,bukd->btkgd", p[..., bound:].astype(cdt), vn,
                      preferred_element_type=f32))
  return ctx.reshape(b, t, h, d).astype(q.dtype)


# Decode attention implementations (``rollout.decode_attention``).
DECODE_ATTENTION = ("blocked", "dense")

# The model's paths, one per job (``Transformer.__call__``, ``.prefill``,
# ``.decode``); a module's ``mode`` picks the attention of its layers.
MODES = ("train", "prefill", "decode", "extend")


class Attention(nn.Module):
  """Grouped-query causal self-attention; ``mode`` is the path (``MODES``).

  ``train`` and ``prefill`` attend causally within the call's tokens
  (``_attend``); ``prefill`` also returns the call's keys/values for the
  caller to write into a cache. ``decode`` reads the cache (never writes it)
  with the ``decode_attention`` kernel and returns the token's new entry.
  ``extend`` runs a chunk of new tokens per row after the row's cached
  context (``_attend_cache_then_chunk``) and returns the chunk's entries.
  """

  cfg: ModelConfig
  mode: str = "train"
  decode_attention: str = "blocked"
  attention_block: int = 0
  kv_bound: int | None = None  # decode: static bound of the entries read (see Transformer.decode)
  window: int = 0  # a local (sliding-window) layer's window; 0 = global

  @nn.compact
  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      mask: jax.Array | None = None,
      cache: tuple[jax.Array, jax.Array] | None = None,
      rows: jax.Array | None = None,
      layer: int | jax.Array = 0,
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
    q = apply_rope(q, positions, cfg, local=bool(self.window))
    k = apply_rope(k, positions, cfg, local=bool(self.window))
    scores = dict(scale=cfg.attention_scale, softcap=cfg.attn_logit_softcap, window=self.window)

    if self.mode == "decode":
      ck, cv = cache  # the whole head-major [L, B, Hkv, S, D] cache, read in place
      # "dense" scores the whole cache in one chunk (the old path, kept to
      # measure against); "blocked" reads the host's bound in chunks.
      s = ck.shape[3]
      bound, chunk = (s, s) if self.decode_attention == "dense" else (
          self.kv_bound or s, decode_chunk(self.attention_block))
      ctx = _attend_cache_and_self(q, k, v, ck, cv, positions, rows, bound, chunk, layer, **scores)
      kv = (k.astype(ck.dtype), v.astype(cv.dtype))
    elif self.mode == "extend":
      ck, cv = cache
      ctx = _attend_cache_then_chunk(q, k, v, ck, cv, positions, rows,
                                     self.kv_bound or ck.shape[3], layer, **scores)
      kv = (k.astype(ck.dtype), v.astype(cv.dtype))
    else:
      ctx = _attend(q, k, v, mask, attention_implementation(cfg), cfg, self.window)
      kv = (k, v) if self.mode == "prefill" else None

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
    return out, kv


class Block(nn.Module):
  """Pre-norm residual block; ``mode`` as in :class:`Attention`; ``moe``: the
  feed-forward is the mixture of experts (``jax_dora.model.moe``)."""

  cfg: ModelConfig
  mode: str = "train"
  decode_attention: str = "blocked"
  attention_block: int = 0
  kv_bound: int | None = None
  moe: bool = False
  replay_routing: bool = False  # route by ``recorded`` (else only compare with it)
  window: int = 0  # a local layer's sliding window (``ModelConfig.layer_window``)

  @nn.compact
  def __call__(self, x, positions, mask=None, cache=None, rows=None, valid=None, layer=0,
               recorded=None):
    """``recorded [B, T, k]``: this MoE layer's routes from the rollout (an input, so
    a rematerialised block replays the same experts in its backward pass)."""
    h, kv = Attention(self.cfg, self.mode, self.decode_attention, self.attention_block,
                      self.kv_bound, self.window, name="attn")(
                          _rms_norm(self.cfg, "attn_norm")(x), positions, mask, cache, rows, layer)
    if self.cfg.post_norms:
      h = _rms_norm(self.cfg, "post_attn_norm")(h)
    x = x + h
    normed = _rms_norm(self.cfg, "mlp_norm")(x)
    if self.moe:
      h = MoE(self.cfg, name="mlp")(normed, valid, recorded, self.replay_routing)
    else:
      h = MLP(self.cfg, name="mlp")(normed)
    if self.cfg.post_norms:
      h = _rms_norm(self.cfg, "post_mlp_norm")(h)
    return x + h, kv


def head_logits(hidden: jax.Array, head: jax.Array, softcap: float = 0.0) -> jax.Array:
  """float32 logits ``hidden[..., D] @ head[D, V]``, computed in ``hidden``'s dtype,
  then ``soft_cap(., softcap)`` (the config's ``final_logit_softcap``: Gemma 2).

  The head is the largest matmul of a decode step and of the learner's
  log-prob pass (V = 151,936). Casting both operands to float32 made it a
  float32 GEMM (no bf16 tensor cores) and, on rollout servers, copied the
  whole embedding to float32 every step; here the weights take the
  activation dtype (as every other layer's do) and only the accumulation
  and the result are float32. With float32 activations (the exactness
  tests) nothing changes. Sampler and learner both call this, so they stay
  one distribution.
  """
  return soft_cap(jnp.einsum("...d,dv->...v", hidden, head.astype(hidden.dtype),
                            preferred_element_type=jnp.float32), softcap)


def head_weight(cfg: ModelConfig, params) -> jax.Array:
  """The LM head as ``[d_model, vocab]`` (the transposed embedding when tied)."""
  if cfg.tie_embeddings:
    return params["embed"]["embedding"].T
  return params["lm_head"]["kernel"]


def stack_layers(tree: dict, n_layers: int) -> dict:
  """A per-layer tree (``layers_0 .. layers_{L-1}``) -> the scanned layout:
  one ``layers`` subtree whose leaves are the layers' leaves stacked on a new
  leading axis; the other entries (embedding, final norm, head) unchanged.

  Works on any tree of that shape: params, ``ShapeDtypeStruct``s (a leaf's
  shape gains the leading ``n_layers``) or logical ``PartitionSpec``s (which
  gain a leading ``"layers"`` axis).
  """
  names = [f"layers_{i}" for i in range(n_layers)]
  if sorted(k for k in tree if k.startswith("layers_")) != sorted(names):
    raise ValueError(f"expected per-layer entries {names[0]}..{names[-1]}, got {sorted(tree)}")
  out = {k: v for k, v in tree.items() if k not in names}
  out["layers"] = jax.tree.map(_stack_leaves, *(tree[n] for n in names),
                               is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  return out


def _stack_leaves(*leaves):
  first = leaves[0]
  if isinstance(first, jax.sharding.PartitionSpec):
    return jax.sharding.PartitionSpec("layers", *first)
  if isinstance(first, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(leaves),) + first.shape, first.dtype)
  return jnp.stack(leaves)


def unstack_layers(tree: dict) -> dict:
  """The inverse of :func:`stack_layers` for arrays: ``layers`` -> ``layers_i``."""
  out = {k: v for k, v in tree.items() if k != "layers"}
  n_layers = jax.tree.leaves(tree["layers"])[0].shape[0]
  for i in range(n_layers):
    out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], tree["layers"])
  return out


class Transformer(nn.Module):
  """Decoder-only LM. See the module docstring for layout and axis names.

  One path per job, each its own method over the same parameters:
  ``__call__`` (training and scoring: the full sequence, causal),
  ``prefill`` (a prompt: causal within it, returns the keys/values to write)
  and ``decode`` (one token per row against the cache, returns the entry to
  commit). Call them as ``model.apply(variables, ..., method=...)``.

  ``remat``: a key of ``REMAT_POLICIES``; rematerialises each block in the
  backward pass (training only; the learner sets it, rollout never does).
  """

  cfg: ModelConfig
  remat: str = "none"
  # Rollout only: how a decode token reads the cache (``DECODE_ATTENTION``)
  # and the block size of the blocked path.
  decode_attention: str = "blocked"
  attention_block: int = 0
  # One block compiled and looped ``n_layers`` times (``nn.scan``) instead of
  # ``n_layers`` unrolled copies: less to compile per program at 16+ layers,
  # more below. Params then live stacked under ``layers`` (``stack_layers``
  # of the per-layer tree). Only the engine sets it (``DoraEngine(scan_layers=)``;
  # the learner's step is slower scanned): DESIGN.md, Scanning over layers.
  scan_layers: bool = False
  # MoE, training only: route by the rollout's recorded experts (``routing``
  # of ``__call__``) instead of this router's top-k: ``learner.moe_routing``.
  replay_routing: bool = False

  def __call__(
      self,
      tokens: jax.Array,
      positions: jax.Array,
      attention_mask: jax.Array | None = None,
      return_hidden: bool = False,
      token_mask: jax.Array | None = None,
      routing: jax.Array | None = None,
  ) -> jax.Array:
    """Training / scoring: the full sequence, causal attention.

    Args:
      tokens: ``[B,T]`` int32 token ids.
      positions: ``[B,T]`` int32 absolute positions (drive RoPE).
      attention_mask: ``[B,T]`` bool, True for real tokens: hides padded
        *keys* (causality is by index). Right-padded rows need none.
      return_hidden: Return the final-normed hidden states ``[B,T,D]``
        instead of logits. With a 150k vocabulary ``[B,T,V]`` float32 logits
        are the largest tensor of a step: the learner computes log-probs
        from the hidden states in chunks (``jax_dora.model.logits``).
      token_mask: ``[B,T]``, real tokens: what an MoE model's router
        statistics (``intermediates``) count; attention is unaffected.
      routing: ``[B,T,moe_layers,k]`` an MoE model's recorded routes
        (``jax_dora.model.routing``): replayed with ``replay_routing``,
        else only compared with the router's own choice (statistics).

    Returns:
      float32 ``logits[B,T,V]``, or the hidden states.
    """
    mask = None if attention_mask is None else attention_mask.astype(bool)
    out, _ = self._forward("train", tokens, positions, mask=mask, return_hidden=return_hidden,
                           valid=token_mask, routing=routing)
    return out

  def prefill(self, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, KVCache]:
    """A batch of prompts: attention within each row (no cache read).

    ``tokens, positions[B,T]``, right-padded rows at positions ``0..T-1``.
    Returns the final-normed hidden states ``[B,T,D]`` (the caller samples
    from the positions it needs with ``head_logits``: ``[B,T,V]`` logits
    would be the largest tensor of the call) and the call's keys/values
    ``KVCache(k, v)`` of ``[L,B,T,Hkv,D]``: the caller writes only these
    entries into its cache (``KVCache.from_prefill``, or the engine's
    scatter into slots), so prefill costs the prompt, not ``max_seq_len``.
    """
    return self._forward("prefill", tokens, positions, return_hidden=True)

  def decode(
      self,
      tokens: jax.Array,
      positions: jax.Array,
      cache: KVCache,
      rows: jax.Array | None = None,
      kv_bound: int | None = None,
  ) -> tuple[jax.Array, KVCache]:
    """One token per row against the cache, which is only read.

    Args:
      tokens, positions: ``[B,1]``; each token attends to its row's cache
        entries ``j < position`` plus itself.
      cache: the whole head-major ``KVCache`` ``[L,Bc,Hkv,S,D]``.
      rows: ``[B]`` cache rows the ``B`` tokens belong to (the cache keeps
        every slot; a DORA pass decodes one version's rows). ``None``: row
        ``b`` is token ``b``.
      kv_bound: a Python int, every row's position is at most this, so the
        blocked kernel reads cache entries ``[0, kv_bound)`` only (``None``:
        the whole cache). Static: one program per bound, no data-dependent
        loop (see ``_attend_cache_and_self``).

    Returns:
      float32 ``logits[B,1,V]`` and the new entries ``KVCache(k, v)`` of
      ``[L,B,1,Hkv,D]`` for the caller to commit (``KVCache.write_step``).
      Writing the cache inside the model would produce an updated copy of
      the whole cache per call, which dominates a decode step; committing
      once, in place, and only for the rows the caller keeps (DORA runs one
      pass per policy version and keeps each row's own version) costs a few
      entries.
    """
    if tokens.shape[1] != 1:
      raise ValueError(f"decode takes one token per row (decode), got [B,T]={tokens.shape}")
    return self._forward("decode", tokens, positions, cache=cache, rows=rows, kv_bound=kv_bound)

  def extend(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, rows: jax.Array,
             kv_bound: int) -> tuple[jax.Array, KVCache]:
    """A chunk of new tokens per row continuing the row's context in the cache.

    ``tokens, positions[B,T]``: row ``b``'s chunk sits at ``start_b ..
    start_b + T - 1`` (``positions[:, 0]`` is the start; right-padded, so a
    real token never sees a padded one) and attends to cache row
    ``rows[b]``'s entries ``j < start_b`` (all below the static ``kv_bound``)
    plus the chunk causally. Same values as :meth:`prefill` of the whole
    context + chunk at those positions. Returns the final-normed hidden
    states ``[B,T,D]`` and the chunk's entries ``KVCache`` ``[L,B,T,Hkv,D]``
    for the caller to write (the cache is only read).
    """
    return self._forward("extend", tokens, positions, cache=cache, rows=rows, kv_bound=kv_bound,
                         return_hidden=True)

  @nn.compact
  def _forward(
      self,
      mode: str,
      tokens: jax.Array,
      positions: jax.Array,
      *,
      mask: jax.Array | None = None,
      cache: KVCache | None = None,
      rows: jax.Array | None = None,
      kv_bound: int | None = None,
      return_hidden: bool = False,
      valid: jax.Array | None = None,
      routing: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """The layers every path shares; ``mode`` (static) picks the attention."""
    cfg = self.cfg
    if mode not in MODES:
      raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if self.decode_attention not in DECODE_ATTENTION:
      raise ValueError(f"decode_attention={self.decode_attention!r} is not one of {DECODE_ATTENTION}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r} is not one of {sorted(REMAT_POLICIES)}")
    tokens = tokens.astype(jnp.int32)
    positions = positions.astype(jnp.int32)

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
    if cfg.scale_embeddings:  # sqrt(d_model) rounded to the parameter dtype, as Gemma's reference
      x = x * jnp.asarray(cfg.d_model ** 0.5, cfg.jnp_param_dtype).astype(x.dtype)

    block_cls = Block
    if self.remat != "none":
      block_cls = nn.remat(Block, policy=REMAT_POLICIES[self.remat], prevent_cse=True)
    layer_cache = None if cache is None else (cache.k, cache.v)  # read whole, in place
    block_args = (cfg, mode, self.decode_attention, self.attention_block, kv_bound)
    if routing is not None and routing.shape[2] != len(cfg.moe_layers):
      raise ValueError(f"routing records {routing.shape[2]} MoE layers, the model has"
                       f" {len(cfg.moe_layers)} ({cfg.moe_layers})")
    if self.scan_layers:
      # One block compiled, run n_layers times over params stacked on a
      # leading "layers" axis; the layer index drives the decode cache read.
      kinds = {cfg.is_moe_layer(i) for i in range(cfg.n_layers)}
      if len(kinds) > 1:
        raise ValueError("scan_layers needs every layer alike: this MoE model mixes dense"
                         f" (mlp_only_layers / moe_layer_step) and MoE layers {cfg.moe_layers}")
      windows = {cfg.layer_window(i) for i in range(cfg.n_layers)}
      if len(windows) > 1:
        raise ValueError("scan_layers needs every layer alike: this model mixes sliding-window"
                         f" layers {cfg.local_layers} and global layers")
      scanned = nn.scan(
          block_cls, variable_axes={"params": 0, "intermediates": 0, ROUTING: 0},
          split_rngs={"params": True},
          in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0,
                   nn.broadcast if routing is None else 0),
          length=cfg.n_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      x, kv = scanned(*block_args, moe=kinds.pop(), replay_routing=self.replay_routing,
                      window=windows.pop(), name="layers")(
          x, positions, mask, layer_cache, rows, valid,
          jnp.arange(cfg.n_layers, dtype=jnp.int32),
          None if routing is None else jnp.moveaxis(routing, 2, 0))
    else:
      per_layer = []
      moe_index = {layer: j for j, layer in enumerate(cfg.moe_layers)}
      for i in range(cfg.n_layers):
        recorded = None if routing is None or i not in moe_index else routing[:, :, moe_index[i]]
        x, kv = block_cls(*block_args, moe=cfg.is_moe_layer(i), replay_routing=self.replay_routing,
                          window=cfg.layer_window(i), name=f"layers_{i}")(
            x, positions, mask, layer_cache, rows, valid, i, recorded)
        per_layer.append(kv)
      kv = None if per_layer[0] is None else tuple(jnp.stack(t) for t in zip(*per_layer))

    x = _rms_norm(cfg, "final_norm")(x)
    if return_hidden:
      out = x
    elif cfg.tie_embeddings:
      out = head_logits(x, embed.embedding.T, cfg.final_logit_softcap)
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
      out = soft_cap(out, cfg.final_logit_softcap)

    if mode == "train":
      return out, None
    return out, KVCache(k=kv[0], v=kv[1])
