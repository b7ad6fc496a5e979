"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): GQA with q/k/v biases (no output bias)."""

from __future__ import annotations

from typing import Any

from jax_dora.model.config import ModelConfig
from jax_dora.model.families import base


def _from_hf(hf: Any) -> dict[str, Any]:
  # Qwen2's attention always has q/k/v biases; there is no config switch.
  return dict(base.common_from_hf(hf), qkv_bias=True, out_bias=False)


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if not cfg.qkv_bias or cfg.out_bias or cfg.qk_norm:
    raise base.UnsupportedCheckpointError(
        "a Qwen2 checkpoint has q/k/v biases, no output bias and no QK-norm")
  return dict(base.common_to_hf(cfg), use_sliding_window=False)


FAMILY = base.Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    from_hf=_from_hf,
    to_hf=_to_hf,
    tensors=base.llama_style_tensors,
    ignored=base.llama_style_ignored,
)
