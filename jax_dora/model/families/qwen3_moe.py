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
  return dict(qwen3._from_hf(hf), **base.moe_from_hf(hf))  # pylint: disable=protected-access


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if not cfg.num_experts:
    raise base.UnsupportedCheckpointError("a dense model exports as qwen3, not qwen3_moe")
  return dict(qwen3._to_hf(cfg), **base.moe_to_hf(cfg))  # pylint: disable=protected-access


FAMILY = base.Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    from_hf=_from_hf,
    to_hf=_to_hf,
    tensors=base.llama_style_tensors,
    ignored=base.llama_style_ignored,
)
