"""Start-up cost guards: what a ``Learner`` traces and compiles, the HF import's
copies, and the persistent compilation cache across processes.

Counts, not timings: a timing assert is noise on a shared 2-core machine, while
a second trace of the Flax init, an extra compiled program, a host copy of
every imported tensor or a cache that stops being hit are exactly the
regressions that made start-up slow, and each shows up as a count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import _hf
import jax
import ml_dtypes
import numpy as np
import pytest
from _compiles import count_compiles

from jax_dora import compile_cache
from jax_dora.config import base_config
from jax_dora.learner.mesh import make_mesh
from jax_dora.learner.train_state import Learner
from jax_dora.model import ModelConfig, Transformer, abstract_params, param_logical_specs
from jax_dora.model.hf_checkpoint import load_params, model_config_from_checkpoint, open_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def model_traces(monkeypatch):
  """A list that receives one entry per trace (or eager run) of the Transformer's forward."""
  calls: list[int] = []
  forward = Transformer.__call__

  def counted(self, *args, **kwargs):
    calls.append(1)
    return forward(self, *args, **kwargs)

  monkeypatch.setattr(Transformer, "__call__", counted)
  return calls


def test_learner_build_traces_the_model_once_and_compiles_one_program(model_traces):
  """The Flax init is traced once per process and config (shared by the learner's
  layout, its init program and the rollout side's abstract params), and building
  the learner compiles one program: seeding, params and optimizer state together."""
  # A config no other test uses, so this process has not traced it yet.
  cfg = ModelConfig(vocab_size=37, d_model=24, n_layers=2, n_heads=2, d_ff=40, max_seq_len=16)
  run = base_config()
  mesh = make_mesh(jax.devices()[:2])
  with count_compiles() as compiled:
    learner = Learner(cfg, run.learner, mesh, seed=1)
    jax.block_until_ready(learner.state)
  assert len(model_traces) == 1
  assert len(compiled) == 1, f"{len(compiled)} programs compiled building the learner"
  # The abstract tree and logical specs come from the same cached trace.
  abstract = abstract_params(cfg)
  param_logical_specs(cfg)
  Learner(cfg, run.learner, mesh, seed=2)
  assert len(model_traces) == 1
  assert jax.tree.structure(abstract) == jax.tree.structure(learner.params)
  for a, p in zip(jax.tree.leaves(abstract), jax.tree.leaves(learner.params)):
    assert (a.shape, a.dtype) == (p.shape, p.dtype)


def test_learner_random_init_is_deterministic_and_seeded():
  """The cheap init key (``INIT_KEY_IMPL``) keeps what random init promises: the
  same seed gives the same params on any mesh, another seed others, and the
  initialisers' distributions (the embedding's unit normal, fan-in-scaled kernels)."""
  cfg = ModelConfig(vocab_size=40, d_model=24, n_layers=2, n_heads=2, d_ff=40, max_seq_len=16)
  run = base_config()
  a = Learner(cfg, run.learner, make_mesh(jax.devices()[:1]), seed=4).params
  b = Learner(cfg, run.learner, make_mesh(jax.devices()[:4], 1, 2, 2), seed=4).params
  c = Learner(cfg, run.learner, make_mesh(jax.devices()[:1]), seed=5).params
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  embed = np.asarray(a["embed"]["embedding"])
  assert not np.array_equal(embed, np.asarray(c["embed"]["embedding"]))
  assert 0.8 < float(embed.std()) < 1.2
  wi = np.asarray(a["layers_0"]["mlp"]["wi_0"]["kernel"])  # lecun_normal: std 1/sqrt(24)
  assert 0.7 < float(wi.std()) * np.sqrt(24) < 1.3
  assert not np.array_equal(wi, np.asarray(a["layers_1"]["mlp"]["wi_0"]["kernel"]))
  np.testing.assert_array_equal(np.asarray(a["final_norm"]["scale"]), 1.0)


def test_hf_import_of_bf16_weights_into_bf16_makes_no_host_copy(tmp_path, monkeypatch):
  """Every device slice handed to JAX is a view of the block read from the file:
  no float32 round trip, no numpy transpose copy (PJRT lays strided views out
  itself, several times faster). A float32 target converts each block once."""
  tok = _hf.build_tokenizer(str(tmp_path / "tok"))
  path = str(tmp_path / "qwen2")
  _hf.build_model("qwen2", path, tok, seed=3, dtype="bfloat16")
  ckpt = open_checkpoint(path)
  handed: list[np.ndarray] = []
  original = jax.make_array_from_callback

  def recording(shape, sharding, callback, *args, **kwargs):
    def record(index):
      out = callback(index)
      handed.append(out)
      return out
    return original(shape, sharding, record, *args, **kwargs)

  monkeypatch.setattr(jax, "make_array_from_callback", recording)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  cfg = model_config_from_checkpoint(ckpt, max_seq_len=32, param_dtype="bfloat16", dtype="float32")
  params = load_params(ckpt, cfg, sharding)
  assert handed and all(a.dtype == ml_dtypes.bfloat16 for a in handed)
  copies = [a.shape for a in handed if a.base is None]
  assert not copies, f"host copies of bf16 tensors before device_put: {copies}"
  assert all(x.dtype == ml_dtypes.bfloat16 for x in jax.tree.leaves(params))

  handed.clear()
  cfg32 = model_config_from_checkpoint(ckpt, max_seq_len=32, param_dtype="float32", dtype="float32")
  params32 = load_params(ckpt, cfg32, sharding)
  assert all(a.dtype == np.float32 for a in handed)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params32)):
    np.testing.assert_array_equal(np.asarray(x).astype(np.float32), np.asarray(y))


def test_compile_cache_dir_setting(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  assert compile_cache.resolve_cache_dir("auto") == str(tmp_path / "xdg" / "jax_dora" / "xla")
  assert compile_cache.resolve_cache_dir(None) == compile_cache.resolve_cache_dir("auto")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert compile_cache.resolve_cache_dir("auto") == str(tmp_path / "env")
  assert compile_cache.resolve_cache_dir("") is None
  assert compile_cache.resolve_cache_dir("~/x") == os.path.expanduser("~/x")
  assert compile_cache.resolve_cache_dir("gs://b/c") == "gs://b/c"
  assert base_config().compile_cache_dir == compile_cache.AUTO


# Builds a small learner and compiles one train step in a fresh process with
# the cache at argv[1]; prints the cache's hit/miss counts as JSON.
_CHILD = textwrap.dedent("""
    import collections, json, sys
    import jax
    from jax_dora.compile_cache import setup_compile_cache
    setup_compile_cache(sys.argv[1])
    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda event, **kw: events.update([event]))
    from jax_dora.config import base_config
    from jax_dora.learner.mesh import make_mesh
    from jax_dora.learner.train_state import Learner
    from jax_dora.model import ModelConfig
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=2, d_ff=48, max_seq_len=16)
    learner = Learner(cfg, base_config().learner, make_mesh(jax.devices()[:2]), seed=0)
    learner.compile_step(4, 16)
    print(json.dumps({k.rsplit("/", 1)[-1]: v for k, v in events.items() if "compilation_cache" in k}))
""")


def _cache_files(path: str) -> set[str]:
  return {f for f in os.listdir(path) if f.endswith("-cache")}


def test_persistent_cache_second_process_loads_instead_of_compiling(tmp_path):
  """Two fresh processes with the same cache directory: the first compiles and
  writes every program, the second finds all of them and compiles nothing."""
  cache = str(tmp_path / "xla")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)

  def child() -> dict[str, int]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, cache], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

  first = child()
  written = _cache_files(cache)
  assert first.get("cache_misses", 0) >= 2 and not first.get("cache_hits")
  assert len(written) == first["cache_misses"]  # every compile is cached, however quick
  second = child()
  assert second.get("cache_hits") == first["cache_misses"], (first, second)
  assert not second.get("cache_misses")
  assert _cache_files(cache) == written
