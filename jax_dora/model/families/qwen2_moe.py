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
  experts = int(getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", 0) or 0)
  if experts < 1:
    raise base.UnsupportedCheckpointError("a Qwen2-MoE config.json without num_experts")
  return dict(
      base.common_from_hf(hf),
      qkv_bias=bool(getattr(hf, "qkv_bias", True)), out_bias=False,
      num_experts=experts,
      num_experts_per_tok=int(hf.num_experts_per_tok),
      moe_d_ff=int(hf.moe_intermediate_size),
      norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
      moe_layer_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
      mlp_only_layers=tuple(int(i) for i in (getattr(hf, "mlp_only_layers", None) or ())),
      router_aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
      shared_expert_d_ff=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
  )


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if not cfg.num_experts or cfg.out_bias or cfg.qk_norm:
    raise base.UnsupportedCheckpointError(
        "a Qwen2-MoE checkpoint has experts, no output bias and no QK-norm")
  return dict(
      base.common_to_hf(cfg), qkv_bias=cfg.qkv_bias, use_sliding_window=False,
      num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
      moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.norm_topk_prob,
      decoder_sparse_step=cfg.moe_layer_step, mlp_only_layers=list(cfg.mlp_only_layers),
      router_aux_loss_coef=cfg.router_aux_loss_coef,
      shared_expert_intermediate_size=cfg.shared_expert_d_ff)


FAMILY = base.Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    from_hf=_from_hf,
    to_hf=_to_hf,
    tensors=base.llama_style_tensors,
    ignored=base.llama_style_ignored,
)
