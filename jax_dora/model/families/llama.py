"""Llama 3 / 3.1 / 3.2 (``LlamaForCausalLM``): GQA, optional attention bias, Llama-3 RoPE scaling."""

from __future__ import annotations

from typing import Any

from jax_dora.model.config import ModelConfig
from jax_dora.model.families import base


def _from_hf(hf: Any) -> dict[str, Any]:
  bias = bool(getattr(hf, "attention_bias", False))
  return dict(base.common_from_hf(hf), qkv_bias=bias, out_bias=bias)


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if cfg.qkv_bias != cfg.out_bias or cfg.qk_norm:
    raise base.UnsupportedCheckpointError(
        "a Llama checkpoint has q/k/v and output biases together (attention_bias) and no QK-norm")
  return dict(base.common_to_hf(cfg), attention_bias=cfg.qkv_bias, mlp_bias=False)


FAMILY = base.Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    from_hf=_from_hf,
    to_hf=_to_hf,
    tensors=base.llama_style_tensors,
    ignored=base.llama_style_ignored,
)
