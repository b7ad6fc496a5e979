"""Imported Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE / Gemma 2 / Gemma 3 checkpoints against
``transformers``' reference models.

The oracle is the independent implementation: the same weights run through
``transformers`` (CPU torch, float32). Our side goes through the real import
path (config.json -> ModelConfig, safetensors shards read slice by slice onto
a sharded mesh), the real rollout engine (prefill, KV-cache decode, the fused
multi-version step, tensor parallelism) and the real export. The Gemma
checkpoints (``_hf.model_config``) have sliding windows shorter than the test
sequences, soft-capping that bends the scores, and several layer-type patterns;
``test_gemma_features_are_exercised`` shows each feature changes the logits, so
the parity checks cannot pass with one of them ignored.
"""

from __future__ import annotations

import json
import os
import shutil

import _hf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

from jax_dora.learner.mesh import logical_axis_rules, make_mesh
from jax_dora.model import Transformer, param_logical_specs
from jax_dora.model.families import UnsupportedCheckpointError
from jax_dora.model.hf_checkpoint import (
    CheckpointError,
    load_params,
    model_config_from_checkpoint,
    open_checkpoint,
)
from jax_dora.model.hf_export import export_hf
from jax_dora.model.hf_tokenizer import HFTokenizer
from jax_dora.rollout.engine import DoraEngine, MultiVersionParams

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3", "gemma3_b")


def _torch_model(path):
  import transformers

  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


def _learner_shardings(cfg):
  """The learner's layout on a (data=2, fsdp=2, tensor=2) mesh: every param split somewhere."""
  import flax.linen as nn

  mesh = make_mesh(jax.devices()[:8], data=2, fsdp=2, tensor=2)
  rules = logical_axis_rules(cfg.n_kv_heads, 2)  # gemma3_b's one KV head: replicated
  with nn.logical_axis_rules(rules):
    return nn.logical_to_mesh_sharding(param_logical_specs(cfg), mesh, rules)


def _never_sampled(tok_dir: str, vocab: int) -> list[int]:
  """Written from the tokenizer files, independently of HFTokenizer: specials that
  are not stop ids (generation_config.json), and the padded vocabulary rows."""
  import transformers

  t = transformers.AutoTokenizer.from_pretrained(tok_dir)
  with open(os.path.join(tok_dir, "generation_config.json")) as f:
    eos = json.load(f)["eos_token_id"]
  stops = set(eos if isinstance(eos, list) else [eos])
  if "<end_of_turn>" in t.get_vocab():  # Gemma's chat turns end there: a stop, not suppressed
    stops.add(t.convert_tokens_to_ids("<end_of_turn>"))
  return sorted(set(t.all_special_ids) - stops) + list(range(len(t), vocab))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(hf_dirs, family):
  ckpt = open_checkpoint(hf_dirs[family])
  assert len({f for f in ckpt.weight_map.values()}) > 1, "expected a sharded checkpoint"
  cfg = model_config_from_checkpoint(ckpt, max_seq_len=64)
  assert cfg.n_kv_heads == (1 if family == "gemma3_b" else 2) and cfg.n_heads == 4
  params = load_params(ckpt, cfg, _learner_shardings(cfg))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 23))
  ours = Transformer(cfg).apply({"params": params}, tokens, np.broadcast_to(np.arange(23), (2, 23)))
  ref = _hf.reference_logits(_torch_model(hf_dirs[family]), tokens)
  np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-5, rtol=1e-4)


# Versions 3 and 4 (and 2, except for qwen2's second checkpoint) are version 1's weights scaled.
_SCALES = {2: 1.1, 3: 0.9, 4: 1.2}


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_decode_matches_transformers_for_four_live_versions(hf_dirs, family):
  """Greedy KV-cache decode through the engine (2-way tensor parallel, four live versions
  in one fused step, batched prefill with a shared-prompt pair, blocked attention over
  the live cache blocks) equals ``transformers``' forward: tokens are its argmax,
  log-probs its log-softmax, suppressed ids excluded."""
  import torch

  tok = HFTokenizer(hf_dirs[family], "chat")
  base = open_checkpoint(hf_dirs[family])
  cfg = model_config_from_checkpoint(base, max_seq_len=96)
  engine = DoraEngine(cfg, tok, num_slots=6, max_prefill_length=32, temperature=0.0,
                      devices=jax.devices()[4:6], tensor_parallel=2, attention_block=24)
  params = {1: load_params(base, cfg, engine.param_sharding)}
  for v, scale in _SCALES.items():
    params[v] = jax.tree.map(lambda x, s=scale: x * s, params[1])
  if family == "qwen2":  # a second, independently initialised checkpoint as version 2
    other = open_checkpoint(hf_dirs["qwen2_b"])
    params[2] = load_params(other, model_config_from_checkpoint(other, max_seq_len=96),
                            engine.param_sharding)
  mv = MultiVersionParams(params, (1, 2, 3, 4))
  prompts = [tok.encode_prompt(t) for t in ("What is 12 + 30?", "Natalia sold 48 clips.",
                                             "How many clips?")]
  prompts.append(prompts[0])  # slots 0 and 3: one prompt, prefilled once
  prompts += [tok.encode_prompt(t) for t in ("Sum 7 and 8.", "Name a prime.")]
  pins = [1, 2, 1, 1, 3, 4]
  state = engine.init_decode_state()
  out, routes = {}, {}  # routes: MoE, the experts each fed token went to (prompt, then decode)
  for v in (1, 2, 3, 4):
    slots = [s for s, pin in enumerate(pins) if pin == v]
    state, firsts, work = engine.prefill_insert_batch_async(
        params[v], v, [prompts[s] for s in slots], slots, state)
    assert work.computed_tokens == sum(len(prompts[s]) for s in set(slots) - {3})
    for slot, first in zip(slots, firsts):
      tok0, lp0 = np.asarray(first.values)[first.row]
      out[slot] = ([int(tok0)], [float(lp0)])
      if engine.routing_shape is not None:
        routes[slot] = list(np.asarray(first.routes)[first.context][:len(prompts[slot])])
  for _ in range(12):
    state, res = engine.generate(mv, state)
    res = res.convert_to_numpy()
    for slot in out:
      out[slot][0].append(int(res.get_result_at_slot(slot).tokens[0, 0]))
      out[slot][1].append(float(res.get_logprobs_at_slot(slot)[0]))
      if engine.routing_shape is not None:
        routes[slot].append(res.routes[slot])

  never = _never_sampled(hf_dirs[family], cfg.vocab_size)
  torch_models = {}
  for v in (1, 2, 3, 4):
    if v == 2 and family == "qwen2":
      torch_models[v] = _torch_model(hf_dirs["qwen2_b"])
      continue
    torch_models[v] = m = _torch_model(hf_dirs[family])
    with torch.no_grad():
      for prm in m.parameters():
        prm.mul_(_SCALES.get(v, 1.0))
  for slot, (p, v) in enumerate(zip(prompts, pins)):
    toks, lps = out[slot]
    seq = np.concatenate([p, toks])
    logits = _hf.reference_logits(torch_models[v], seq[None])[0]
    logits[:, never] = -np.inf
    logp = torch.log_softmax(torch.from_numpy(logits), dim=-1).numpy()
    n = len(p)
    np.testing.assert_array_equal(toks, logp[n - 1:len(seq) - 1].argmax(-1))
    np.testing.assert_allclose(lps, logp[np.arange(n - 1, len(seq) - 1), seq[n:]], atol=2e-4)
    assert not set(toks) & set(never)
    if engine.routing_shape is not None:
      # Routing replay's record: every token the server ran (the prompt in
      # prefill, each sampled token but the last in decode), each MoE layer's
      # top-k, equals transformers' routers on the same sequence.
      ref = _hf.reference_routes(torch_models[v], seq[:-1], cfg.num_experts_per_tok)
      np.testing.assert_array_equal(np.sort(np.stack(routes[slot]), -1), np.sort(ref, -1))


def _tokenizer_dir(hf_dirs, family: str) -> str:
  return hf_dirs["gemma_tokenizer" if family.startswith("gemma") else "tokenizer"]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3"])
def test_import_export_round_trip_is_bit_exact_and_transformers_loads_it(hf_dirs, tmp_path, family):
  src = str(tmp_path / "bf16")
  _hf.build_model(family, src, _tokenizer_dir(hf_dirs, family), seed=3, dtype="bfloat16",
                  shard=False)
  ckpt = open_checkpoint(src)
  assert ckpt.torch_dtype == "bfloat16"
  cfg = model_config_from_checkpoint(ckpt, max_seq_len=64)  # float32 params
  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
  params = load_params(ckpt, cfg, NamedSharding(mesh, P()))
  out = export_hf(params, cfg, str(tmp_path / "out"), source_dir=src, max_shard_bytes=60_000)
  assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  orig = load_file(os.path.join(src, "model.safetensors"))
  exported = {}
  for f in sorted(os.listdir(out)):
    if f.endswith(".safetensors"):
      exported.update(load_file(os.path.join(out, f)))
  assert set(exported) == set(orig)
  for name, a in orig.items():
    b = exported[name]
    assert b.dtype == a.dtype == ml_dtypes.bfloat16 and b.shape == a.shape, name
    assert a.tobytes() == b.tobytes(), f"{name} differs after import -> export"
  # transformers loads the export; its float32 forward equals ours.
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 17))
  ref = _hf.reference_logits(_torch_model(out), tokens)
  ours = Transformer(cfg).apply({"params": params}, tokens, np.arange(17)[None])
  np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-5, rtol=1e-4)
  assert HFTokenizer(out, "chat").encode_prompt("2+2?").tolist() == \
      HFTokenizer(src, "chat").encode_prompt("2+2?").tolist()


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gemma3_b"])
def test_gemma_config_exports_without_its_source_and_transformers_runs_it(hf_dirs, tmp_path, family):
  """Export with no source directory: config.json is written from ``ModelConfig`` by the
  family's ``to_hf`` (layer types, window, RoPE per layer type, soft-caps, query scalar),
  and ``transformers`` computes the same logits from it."""
  ckpt = open_checkpoint(hf_dirs[family])
  cfg = model_config_from_checkpoint(ckpt, max_seq_len=64)
  params = load_params(ckpt, cfg, NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), P()))
  out = export_hf(params, cfg, str(tmp_path / "out"))
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["model_type"] == ckpt.family.name
  again = model_config_from_checkpoint(open_checkpoint(out), max_seq_len=64)
  assert again == cfg
  tokens = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(1, 21))
  ref = _hf.reference_logits(_torch_model(out), tokens)
  ours = Transformer(cfg).apply({"params": params}, tokens, np.arange(21)[None])
  np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-5, rtol=1e-4)


def test_native_model_exports_as_llama_that_transformers_runs(tmp_path):
  from jax_dora.model import CharTokenizer, ModelConfig, init_params

  cfg = ModelConfig(vocab_size=CharTokenizer().vocab_size, d_model=32, n_layers=2, n_heads=4,
                    d_ff=64, max_seq_len=32)
  params = init_params(cfg, jax.random.PRNGKey(4))
  out = export_hf(params, cfg, str(tmp_path / "native"))
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
  tokens = np.arange(3, 20)[None]
  ref = _hf.reference_logits(_torch_model(out), tokens)
  ours = Transformer(cfg).apply({"params": params}, tokens, np.arange(17)[None])
  np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-5, rtol=1e-4)


def _copy(src: str, dst) -> str:
  shutil.copytree(src, dst)
  return str(dst)


def test_bad_checkpoints_fail_loudly_naming_the_file(hf_dirs, tmp_path):
  good = hf_dirs["qwen2"]
  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
  rep = NamedSharding(mesh, P())

  # A shard listed in the index is missing.
  d = _copy(good, tmp_path / "missing")
  with open(os.path.join(d, "model.safetensors.index.json")) as f:
    victim = sorted(set(json.load(f)["weight_map"].values()))[1]
  os.remove(os.path.join(d, victim))
  with pytest.raises(CheckpointError, match=f"{victim} is missing"):
    open_checkpoint(d)

  # A truncated shard.
  d = _copy(good, tmp_path / "truncated")
  path = os.path.join(d, victim)
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match=f"{victim} is corrupt or truncated"):
    open_checkpoint(d)

  # config.json disagrees with the tensors.
  d = _copy(good, tmp_path / "shape")
  with open(os.path.join(d, "config.json")) as f:
    conf = json.load(f)
  conf["intermediate_size"] = 128
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(conf, f)
  ckpt = open_checkpoint(d)
  with pytest.raises(CheckpointError, match=r"mlp\.(gate|up|down)_proj\.weight has shape"):
    load_params(ckpt, model_config_from_checkpoint(ckpt, max_seq_len=32), rep)

  # An architecture we do not implement.
  d = _copy(good, tmp_path / "gpt2")
  conf["model_type"], conf["architectures"] = "gpt2", ["GPT2LMHeadModel"]
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(conf, f)
  with pytest.raises(UnsupportedCheckpointError, match="unknown architecture: model_type='gpt2'"):
    open_checkpoint(d)

  # An explicit run-config value that disagrees with config.json.
  with pytest.raises(CheckpointError, match=r"model\.d_model=128 in the run config.*gives 64"):
    model_config_from_checkpoint(open_checkpoint(good), {"d_model": 128}, max_seq_len=32)

  # No config.json at all.
  d = _copy(good, tmp_path / "noconf")
  os.remove(os.path.join(d, "config.json"))
  with pytest.raises(CheckpointError, match="config.json does not exist"):
    open_checkpoint(d)


def test_bf16_activations_and_cache_stay_close_to_float32(hf_dirs):
  """dtype=bfloat16: bf16 activations and KV cache, float32 logits; close to float32."""
  ckpt = open_checkpoint(hf_dirs["qwen3"])
  f32 = model_config_from_checkpoint(ckpt, max_seq_len=64)
  bf16 = model_config_from_checkpoint(ckpt, max_seq_len=64, param_dtype="bfloat16", dtype="bfloat16")
  rep = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), P())
  p32, p16 = load_params(ckpt, f32, rep), load_params(ckpt, bf16, rep)
  assert jax.tree.leaves(p16)[0].dtype == jnp.bfloat16
  tokens = np.arange(5, 25)[None]
  pos = np.arange(20)[None]
  a = Transformer(f32).apply({"params": p32}, tokens, pos)
  b = Transformer(bf16).apply({"params": p16}, tokens, pos)
  assert b.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=0.05)


def test_servers_hold_a_float32_snapshot_as_bfloat16_when_asked(hf_dirs, tmp_path):
  """rollout.param_dtype=bfloat16: the learner's float32 snapshot is cast on restore
  (each value rounded as numpy's bfloat16 cast rounds it) and decodes like float32."""
  from jax_dora.config import base_config, hf_model_config
  from jax_dora.policy import resolve_policy
  from jax_dora.rollout.engine import build_engine
  from jax_dora.snapshots import SnapshotPublisher, SnapshotReader

  cfg = base_config()
  cfg.model = hf_model_config(hf_dirs["qwen3"], max_seq_len=64)
  cfg.rollout.max_prefill_length = 32
  cfg.rollout.slots = 2
  cfg.rollout.temperature = 0.0
  policy = resolve_policy(cfg)
  rep = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), P())
  params = load_params(policy.checkpoint, policy.model_cfg, rep)
  with SnapshotPublisher(tmp_path / "snaps") as pub:
    pub.publish(5, params)
  reader = SnapshotReader(tmp_path / "snaps")
  engines = {}
  for dtype in ("", "bfloat16"):
    cfg.rollout.param_dtype = dtype
    engines[dtype] = build_engine(cfg, jax.devices()[6:7], policy=policy)
  f32 = engines[""].load_params(reader, 5)
  bf16 = engines["bfloat16"].load_params(reader, 5)
  for a, b in zip(jax.tree.leaves(f32), jax.tree.leaves(bf16)):
    assert a.dtype == jnp.float32 and b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a).astype(ml_dtypes.bfloat16))
  prompt = policy.tokenizer.encode_prompt("What is 12 + 30?")
  lps = {}
  for key, p in (("", f32), ("bfloat16", bf16)):
    e = engines[key]
    padded, n = e.pad_tokens(prompt)
    prefix = e.prefill(params=MultiVersionParams.single(5, p), padded_tokens=padded, true_length=n)
    lps[key] = float(prefix.logprob)
  assert abs(lps["bfloat16"] - lps[""]) < 0.05
