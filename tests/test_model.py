"""Tests for jax_dora.model: KV-cache equivalence, tokenizer, sharding specs.

The cache tests compare incremental decoding against a full re-forward of the
growing sequence, which is the property rollout correctness (and therefore
the learner's importance ratios) depends on.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_dora.learner.mesh import LOGICAL_AXIS_RULES, make_mesh
from jax_dora.model import (
    CharTokenizer,
    KVCache,
    ModelConfig,
    Transformer,
    head_logits,
    head_weight,
    init_params,
    param_logical_specs,
    token_logprobs,
)

TOK = CharTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32)
MODEL = Transformer(CFG)


@functools.lru_cache(maxsize=None)
def _params():
  return init_params(CFG, jax.random.PRNGKey(0))


@jax.jit
def _full(params, tokens):
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  return MODEL.apply({"params": params}, tokens, pos)


@jax.jit
def _prefill(params, tokens):
  """Prompt logits ``[B,T,V]`` and a cache holding the prompt's entries."""
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  hidden, kv = MODEL.apply({"params": params}, tokens, pos, method=Transformer.prefill)
  return head_logits(hidden, head_weight(CFG, params)), KVCache.from_prefill(kv, CFG.max_seq_len)


@jax.jit
def _decode(params, tokens, positions, cache):
  """One decode step: logits and the cache with every row's entry committed."""
  logits, new = MODEL.apply({"params": params}, tokens, positions, cache, method=Transformer.decode)
  return logits, cache.write_step(new, positions[:, 0], jnp.ones(tokens.shape[0], bool))


def _prefill_padded(prompt: np.ndarray, pad_to: int) -> np.ndarray:
  return np.pad(prompt, (0, pad_to - len(prompt)), constant_values=TOK.pad_id)


def test_kv_cache_greedy_matches_full_forward():
  params = _params()
  prompt = np.array([5, 9, 12, 20, 7], np.int32)
  tokens = _prefill_padded(prompt, 8)[None]
  logits, cache = _prefill(params, jnp.asarray(tokens))
  assert logits.shape == (1, 8, CFG.vocab_size) and logits.dtype == jnp.float32
  assert cache.k.shape == (CFG.n_layers, 1, CFG.n_kv_heads, CFG.max_seq_len, CFG.head_dim)
  seq = list(prompt)
  step_logits = logits[0, len(prompt) - 1]
  for _ in range(10):
    full = _full(params, jnp.asarray([seq], jnp.int32))[0, -1]
    np.testing.assert_allclose(step_logits, full, atol=1e-4)
    nxt = int(jnp.argmax(step_logits))
    assert nxt == int(jnp.argmax(full))
    pos = len(seq)
    seq.append(nxt)
    out, cache = _decode(params, jnp.asarray([[nxt]], jnp.int32), jnp.asarray([[pos]], jnp.int32),
                         cache)
    step_logits = out[0, 0]


def test_batched_decode_with_different_positions_matches_per_row():
  params = _params()
  lens = [3, 6]
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, CFG.vocab_size, size=n).astype(np.int32) for n in lens]
  batch_tokens = np.stack([_prefill_padded(p, 8) for p in prompts])
  _, bcache = _prefill(params, jnp.asarray(batch_tokens))
  rcaches = [_prefill(params, jnp.asarray(batch_tokens[i : i + 1]))[1] for i in range(2)]
  next_tok = np.array([[4], [11]], np.int32)
  positions = np.array([[lens[0]], [lens[1]]], np.int32)
  for _ in range(3):
    blogits, bcache = _decode(params, jnp.asarray(next_tok), jnp.asarray(positions), bcache)
    for i in range(2):
      rl, rcaches[i] = _decode(
          params, jnp.asarray(next_tok[i : i + 1]), jnp.asarray(positions[i : i + 1]), rcaches[i]
      )
      np.testing.assert_allclose(blogits[i], rl[0], atol=1e-5)
    next_tok = np.asarray(jnp.argmax(blogits, -1), np.int32)
    positions = positions + 1


@jax.jit
def _decode_entries(params, tokens, positions, cache):
  return MODEL.apply({"params": params}, tokens, positions, cache, method=Transformer.decode)


def test_decode_commits_the_entries_prefill_computes():
  """Decode only reads the cache; the entries it returns, committed for
  chosen rows, are the ones a prefill of the whole sequence computes, and
  its logits are the full forward's."""
  params = _params()
  rng = np.random.default_rng(1)
  lens = [2, 5, 9]
  seqs = [list(rng.integers(3, CFG.vocab_size, size=n).astype(np.int32)) for n in lens]
  _, cache = _prefill(params, jnp.asarray(np.stack([_prefill_padded(np.asarray(q), 16)
                                                     for q in seqs])))
  tok = jnp.asarray([[4], [11], [7]], jnp.int32)
  positions = jnp.asarray([[n] for n in lens], jnp.int32)
  for _ in range(4):
    got, new = _decode_entries(params, tok, positions, cache)
    assert new.k.shape == (CFG.n_layers, 3, 1, CFG.n_kv_heads, CFG.head_dim)
    for i, q in enumerate(seqs):
      q.append(int(tok[i, 0]))
      want = _full(params, jnp.asarray([q], jnp.int32))[0, -1]
      np.testing.assert_allclose(got[i, 0], want, atol=1e-5)
    cache = cache.write_step(new, positions[:, 0], jnp.ones(3, bool))
    tok = jnp.argmax(got, -1).astype(jnp.int32)
    positions = positions + 1
  # The committed cache holds what a prefill of each whole sequence computes.
  for i, q in enumerate(seqs):
    _, ref = _prefill(params, jnp.asarray([q], jnp.int32))
    n = len(q)
    np.testing.assert_allclose(cache.k[:, i, :, :n], ref.k[:, 0, :, :n], atol=1e-5)
    np.testing.assert_allclose(cache.v[:, i, :, :n], ref.v[:, 0, :, :n], atol=1e-5)
  # Uncommitted rows keep their cache.
  _, new = _decode_entries(params, tok, positions, cache)
  kept = cache.write_step(new, positions[:, 0], jnp.asarray([True, False, False]))
  np.testing.assert_array_equal(kept.k[:, 1:], cache.k[:, 1:])
  assert not np.array_equal(kept.k[:, 0], cache.k[:, 0])
  with pytest.raises(ValueError, match="one token per row"):
    MODEL.apply({"params": params}, tok.repeat(2, axis=1), jnp.zeros((3, 2), jnp.int32), cache,
                method=Transformer.decode)


def test_attention_mask_hides_padded_keys():
  params = _params()
  # Left-padded row: with the mask, the real suffix must not see the pads, so
  # its last logits match the unpadded sequence at the same positions.
  real = jnp.asarray([[5, 9, 12]], jnp.int32)
  padded = jnp.asarray([[0, 0, 5, 9, 12]], jnp.int32)
  mask = jnp.asarray([[False, False, True, True, True]])
  pos = jnp.asarray([[0, 0, 0, 1, 2]], jnp.int32)
  out = MODEL.apply({"params": params}, padded, pos, attention_mask=mask)
  ref = _full(params, real)
  np.testing.assert_allclose(out[0, 2:], ref[0], atol=1e-5)
  assert np.isfinite(np.asarray(out)).all()


def test_token_logprobs():
  logits = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 7))
  targets = jnp.asarray([[0, 1, 6], [3, 3, 2]], jnp.int32)
  lp = token_logprobs(logits, targets)
  ref = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), np.asarray(targets)[..., None], -1)
  assert lp.shape == (2, 3) and lp.dtype == jnp.float32
  np.testing.assert_allclose(lp, ref[..., 0], atol=1e-6)


def test_tokenizer_round_trip_padding_and_errors():
  text = "12+34=46, (sort: [b a])?"
  ids = TOK.encode_ids(text)
  assert ids.dtype == np.int32 and (ids >= 3).all()
  assert TOK.decode(ids) == text
  toks, n = TOK.encode(text, is_bos=True, max_prefill_length=32)
  assert toks.shape == (32,) and toks.dtype == np.int32 and n == len(text) + 1
  assert toks[0] == TOK.bos_id and (toks[n:] == TOK.pad_id).all()
  assert TOK.decode(toks) == text
  assert TOK.decode(list(ids[:3]) + [TOK.eos_id] + list(ids[3:])) == text[:3]
  toks, n = TOK.encode("ab")
  assert n == 2 and toks.tolist() == TOK.encode_ids("ab").tolist()
  with pytest.raises(ValueError, match="'A'"):
    TOK.encode_ids("abA")
  with pytest.raises(ValueError, match="max_prefill_length"):
    TOK.encode("abcdef", max_prefill_length=4)
  assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
  assert TOK.vocab_size == 3 + 10 + 26 + 17


def test_config_from_config_dict():
  d = ml_collections.ConfigDict(dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=16))
  cfg = ModelConfig.from_config_dict(d, vocab_size=TOK.vocab_size)
  assert cfg.head_dim == 16 and cfg.vocab_size == TOK.vocab_size and cfg.rope_theta == 10000.0
  with pytest.raises(ValueError):
    ModelConfig.from_config_dict(d)


def test_param_logical_specs_tree_matches_params():
  params = _params()
  specs = param_logical_specs(CFG)
  is_spec = lambda x: isinstance(x, P)
  assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(params)
  flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
  flat_params = jax.tree.leaves(params)
  for spec, p in zip(flat_specs, flat_params):
    assert len(spec) == p.ndim
  assert specs["embed"]["embedding"] == P("vocab", "embed")
  assert specs["layers_0"]["attn"]["query"]["kernel"] == P("embed", "heads", "kv")
  assert specs["layers_0"]["mlp"]["wi_0"]["kernel"] == P("embed", "mlp")
  assert specs["lm_head"]["kernel"] == P("embed", "vocab")


def test_params_shard_with_learner_rules():
  mesh = make_mesh(jax.devices()[:8], data=2, fsdp=2, tensor=2)
  shardings = nn.logical_to_mesh_sharding(param_logical_specs(CFG), mesh, LOGICAL_AXIS_RULES)
  params = jax.jit(lambda r: init_params(CFG, r), out_shardings=shardings)(jax.random.PRNGKey(0))
  assert params["layers_0"]["mlp"]["wi_0"]["kernel"].sharding.spec == P("fsdp", "tensor")
  np.testing.assert_allclose(
      _full(params, jnp.asarray([[5, 6, 7]])), _full(_params(), jnp.asarray([[5, 6, 7]])), atol=1e-5
  )
