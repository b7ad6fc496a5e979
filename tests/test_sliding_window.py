"""Sliding-window (local) layers on every path: decode and extend equal the full forward.

The full forward's window is checked against ``transformers``' Gemma 2 / 3 in
``test_hf_models``; here a Gemma-shaped native model (local and global layers,
soft-capped scores and logits, ``1 + w`` and sandwich norms) decodes token by
token through the blocked cache kernel, whose local layers read only each
row's window (per-row chunks starting at ``position - window + 1``), and
continues a cached context with ``extend``. Every step must equal a full
forward of the whole sequence, for rows at different positions, with the
kernel's ``rows`` gather and without it, and for windows shorter than, equal
to and longer than one chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dora.model import KVCache, ModelConfig, Transformer, head_logits, head_weight, init_params


def _cfg(window: int) -> ModelConfig:
  return ModelConfig(
      vocab_size=61, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=40,
      mlp_activation="gelu_tanh", norm_scale_offset=1.0, post_norms=True, scale_embeddings=True,
      query_pre_attn_scalar=12.0, attn_logit_softcap=1.0, final_logit_softcap=4.0,
      sliding_window=window, local_layers=(0, 2), rope_local_theta=100.0, qk_norm=True)


@functools.lru_cache(maxsize=None)
def _params(window: int):
  params = init_params(_cfg(window), jax.random.PRNGKey(window))
  # Larger q/k weights: scores that the soft-cap bends and a softmax that is not flat.
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x * 4.0 if any(getattr(k, "key", "") in ("query", "key") for k in path)
      else x, params)


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, tokens):
  pos = jnp.arange(tokens.shape[1])[None]
  return Transformer(cfg).apply({"params": params}, tokens, pos)[0]


def _full_logits(cfg, params, seq):
  """The full forward's logits at ``seq``'s positions (right-padded to the cache length: causal,
  so the padding changes nothing before it, and one program serves every length)."""
  padded = np.zeros((1, cfg.max_seq_len), np.int32)
  padded[0, :len(seq)] = seq
  return np.asarray(_forward(cfg, params, padded))[:len(seq)]


@pytest.mark.parametrize("window,chunk", [(4, 2), (4, 8), (1, 2), (40, 4)])
def test_decode_reads_only_the_window_and_equals_the_full_forward(window, chunk):
  cfg = _cfg(window)
  params = _params(window)
  model = Transformer(cfg, attention_block=chunk)
  rng = np.random.default_rng(window)
  prompts = [rng.integers(0, cfg.vocab_size, n) for n in (3, 9)]
  width = 9
  tokens = np.stack([np.pad(p, (0, width - len(p))) for p in prompts])
  hidden, kv = model.apply({"params": params}, tokens, np.broadcast_to(np.arange(width), (2, width)),
                           method=Transformer.prefill)
  cache = KVCache.from_prefill(kv, cfg.max_seq_len)
  seqs = [list(p) for p in prompts]
  last = np.asarray(head_logits(hidden, head_weight(cfg, params), cfg.final_logit_softcap))
  step = [last[b, len(p) - 1] for b, p in enumerate(prompts)]

  @functools.partial(jax.jit, static_argnames=("bound", "with_rows"))
  def decode(params, tok, pos, cache, bound, with_rows):
    rows = jnp.arange(2) if with_rows else None
    return model.apply({"params": params}, tok, pos, cache, rows, bound, method=Transformer.decode)

  for i in range(14):
    for b in range(2):
      np.testing.assert_allclose(step[b], _full_logits(cfg, params, seqs[b])[-1], atol=2e-5)
    nxt = np.array([[int(np.argmax(s))] for s in step], np.int32)
    pos = np.array([[len(s)] for s in seqs], np.int32)
    bound = int(-(-(pos.max() + 1) // 8) * 8)
    logits, new = decode(params, nxt, pos, cache, bound, with_rows=bool(i % 2))
    cache = cache.write_step(new, jnp.asarray(pos[:, 0]), jnp.ones(2, bool))
    for b in range(2):
      seqs[b].append(int(nxt[b, 0]))
    step = list(np.asarray(logits)[:, 0])


def test_extend_continues_a_cached_context_through_the_window():
  """A chunk of 6 new tokens after 11 cached ones (window 4: the chunk's first tokens still
  read cached entries, its later ones only the chunk) equals the full forward's last 6."""
  cfg = _cfg(4)
  params = _params(4)
  model = Transformer(cfg)
  seq = np.random.default_rng(1).integers(0, cfg.vocab_size, 17)
  ctx, new = seq[:11], seq[11:]
  _, kv = model.apply({"params": params}, ctx[None], np.arange(11)[None], method=Transformer.prefill)
  cache = KVCache.from_prefill(kv, cfg.max_seq_len)
  hidden, _ = model.apply({"params": params}, new[None], np.arange(11, 17)[None], cache,
                          np.array([0]), 16, method=Transformer.extend)
  ours = np.asarray(head_logits(hidden, head_weight(cfg, params), cfg.final_logit_softcap))[0]
  np.testing.assert_allclose(ours, _full_logits(cfg, params, seq)[11:], atol=2e-5)


def test_window_and_softcaps_change_the_result():
  """The checks above are not vacuous: without the window (or a soft-cap) the logits move."""
  import dataclasses

  cfg, params = _cfg(4), _params(4)
  seq = np.random.default_rng(2).integers(0, cfg.vocab_size, 20)
  ref = _full_logits(cfg, params, seq)
  for change in (dict(sliding_window=0, local_layers=()), dict(attn_logit_softcap=0.0),
                 dict(final_logit_softcap=0.0), dict(rope_local_theta=0.0)):
    other = _full_logits(dataclasses.replace(cfg, **change), params, seq)
    assert np.abs(other - ref).max() > 1e-3, change


def test_config_rejects_local_layers_without_a_window_and_scan_of_mixed_layers():
  with pytest.raises(ValueError, match="sliding_window"):
    ModelConfig(vocab_size=8, n_layers=2, local_layers=(0,))
  with pytest.raises(ValueError, match="outside"):
    ModelConfig(vocab_size=8, n_layers=2, sliding_window=4, local_layers=(2,))
  cfg = _cfg(4)
  with pytest.raises(ValueError, match="sliding-window"):
    Transformer(cfg, scan_layers=True).init(jax.random.PRNGKey(0), np.zeros((1, 4), np.int32),
                                            np.arange(4)[None])
