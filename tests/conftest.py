"""Session fixtures shared by the real-model tests; a compilation cache for child processes."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import jax  # noqa: F401  (reads this process's JAX config before the cache dir is exported)
import pytest

# Tests start many child processes (train CLI runs, killed-and-resumed
# learners, rollout servers, the notebook kernel) that compile the same
# tiny-model programs again and again: a persistent XLA cache shared by this
# session's children turns the repeats into loads (the killed-run test alone
# starts three learners). Not for this process: its compile-counting tests
# (_compiles.py) must see real compiles, so the variable is exported only
# after JAX read its config here.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="jax_dora_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
  """``{"tokenizer": dir, "llama"|"qwen2"|"qwen3"|"qwen3_moe"|"qwen2_moe": model dir, "qwen2_b": a
  second qwen2, "gemma_tokenizer": dir, "gemma2"|"gemma3"|"gemma3_b": model dir}``.

  Built once per session with ``transformers`` (see ``_hf``).
  """
  import _hf

  root = tmp_path_factory.mktemp("hf")
  tok = _hf.build_tokenizer(str(root / "tokenizer"))
  out = {"tokenizer": tok}
  for kind in ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
    d = str(root / kind)
    _hf.build_model(kind, d, tok, seed=1)
    out[kind] = d
  out["qwen2_b"] = str(root / "qwen2_b")
  _hf.build_model("qwen2", out["qwen2_b"], tok, seed=2)
  out["gemma_tokenizer"] = gemma_tok = _hf.build_gemma_tokenizer(str(root / "gemma_tokenizer"))
  for kind in ("gemma2", "gemma3", "gemma3_b"):
    out[kind] = str(root / kind)
    _hf.build_model(kind, out[kind], gemma_tok, seed=1)
  return out
