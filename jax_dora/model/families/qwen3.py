"""Qwen3 dense (``Qwen3ForCausalLM``): GQA, per-head RMSNorm on q and k, ``head_dim`` set apart."""

from __future__ import annotations

from typing import Any

from jax_dora.model.config import ModelConfig
from jax_dora.model.families import base


def _from_hf(hf: Any) -> dict[str, Any]:
  bias = bool(getattr(hf, "attention_bias", False))
  return dict(base.common_from_hf(hf), qkv_bias=bias, out_bias=bias, qk_norm=True)


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if not cfg.qk_norm or cfg.qkv_bias != cfg.out_bias:
    raise base.UnsupportedCheckpointError(
        "a Qwen3 checkpoint has QK-norm and q/k/v/o biases together or not at all")
  return dict(base.common_to_hf(cfg), attention_bias=cfg.qkv_bias, use_sliding_window=False)


FAMILY = base.Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    from_hf=_from_hf,
    to_hf=_to_hf,
    tensors=base.llama_style_tensors,
    ignored=base.llama_style_ignored,
)
