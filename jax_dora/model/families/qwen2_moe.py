"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2 attention with routed experts plus a shared expert.

Each MoE layer: a router over ``num_experts`` SwiGLU experts (top-k, by
default not renormalised), and a shared SwiGLU expert of width
``shared_expert_intermediate_size`` that every token passes through, scaled
by ``sigmoid(shared_expert_gate(x))``. Tensor names as Qwen3-MoE's plus
``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight`` (``base.moe_tensors``).
"""

from __future__ import annotations

from typing import Any

from jax_dora.model.config import ModelConfig
from jax_dora.model.families import base


def _from_hf(hf: Any) -> dict[str, Any]:
  return dict(
      base.common_from_hf(hf), **base.moe_from_hf(hf),
      qkv_bias=bool(getattr(hf, "qkv_bias", True)), out_bias=False,
      shared_expert_d_ff=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0))


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if not cfg.num_experts or cfg.out_bias or cfg.qk_norm:
    raise base.UnsupportedCheckpointError(
        "a Qwen2-MoE checkpoint has experts, no output bias and no QK-norm")
  return dict(base.common_to_hf(cfg), **base.moe_to_hf(cfg), qkv_bias=cfg.qkv_bias,
              use_sliding_window=False, shared_expert_intermediate_size=cfg.shared_expert_d_ff)


FAMILY = base.Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    from_hf=_from_hf,
    to_hf=_to_hf,
    tensors=base.llama_style_tensors,
    ignored=base.llama_style_ignored,
)
