"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention with a mixture-of-experts feed-forward.

Router ``mlp.gate.weight [experts, hidden]``, per-expert SwiGLU tensors
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (stacked on our ``expert``
axis, ``base.moe_tensors``); layers in ``mlp_only_layers`` or off the
``decoder_sparse_step`` keep the dense MLP of width ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from jax_dora.model.config import ModelConfig
from jax_dora.model.families import base, qwen3


def _from_hf(hf: Any) -> dict[str, Any]:
  experts = int(getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", 0) or 0)
  if experts < 1:
    raise base.UnsupportedCheckpointError("a Qwen3-MoE config.json without num_experts")
  return dict(
      qwen3._from_hf(hf),  # pylint: disable=protected-access
      num_experts=experts,
      num_experts_per_tok=int(hf.num_experts_per_tok),
      moe_d_ff=int(hf.moe_intermediate_size),
      norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
      moe_layer_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
      mlp_only_layers=tuple(int(i) for i in (getattr(hf, "mlp_only_layers", None) or ())),
      router_aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
  )


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if not cfg.num_experts:
    raise base.UnsupportedCheckpointError("a dense model exports as qwen3, not qwen3_moe")
  return dict(
      qwen3._to_hf(cfg),  # pylint: disable=protected-access
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      moe_intermediate_size=cfg.moe_d_ff,
      norm_topk_prob=cfg.norm_topk_prob,
      decoder_sparse_step=cfg.moe_layer_step,
      mlp_only_layers=list(cfg.mlp_only_layers),
      router_aux_loss_coef=cfg.router_aux_loss_coef,
  )


FAMILY = base.Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    from_hf=_from_hf,
    to_hf=_to_hf,
    tensors=base.llama_style_tensors,
    ignored=base.llama_style_ignored,
)
