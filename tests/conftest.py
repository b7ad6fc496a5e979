"""Session fixtures shared by the real-model tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
  """``{"tokenizer": dir, "llama"|"qwen2"|"qwen3": model dir, "qwen2_b": a second qwen2}``.

  Built once per session with ``transformers`` (see ``_hf``).
  """
  import _hf

  root = tmp_path_factory.mktemp("hf")
  tok = _hf.build_tokenizer(str(root / "tokenizer"))
  out = {"tokenizer": tok}
  for kind in ("llama", "qwen2", "qwen3"):
    d = str(root / kind)
    _hf.build_model(kind, d, tok, seed=1)
    out[kind] = d
  out["qwen2_b"] = str(root / "qwen2_b")
  _hf.build_model("qwen2", out["qwen2_b"], tok, seed=2)
  return out
