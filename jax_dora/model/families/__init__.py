"""Model families importable from / exportable to Hugging Face checkpoints.

Adding a family: a module defining a ``base.Family`` and one line below.
Gemma 2/3 switch on the block's Gemma pieces through ``ModelConfig`` (GeGLU,
``1 + w`` norms, sandwich norms, scaled embeddings, soft-capping,
sliding-window layers) and share the Llama tensor naming plus two norms.
"""

from __future__ import annotations

from jax_dora.model.config import ModelConfig
from jax_dora.model.families import gemma2, gemma3, llama, qwen2, qwen2_moe, qwen3, qwen3_moe
from jax_dora.model.families.base import (
    Family,
    TensorLayout,
    TensorMap,
    UnsupportedCheckpointError,
)
from jax_dora.registry import Registry

FAMILIES: Registry[Family] = Registry("model family", plural="model families")


def register(family: Family) -> Family:
  """Adds ``family`` under its ``name``, the HF ``model_type`` checkpoints are matched on."""
  return FAMILIES.register(family.name, family)


register(llama.FAMILY)
register(qwen2.FAMILY)
register(qwen3.FAMILY)
register(qwen3_moe.FAMILY)
register(qwen2_moe.FAMILY)
register(gemma2.FAMILY)
register(gemma3.FAMILY)


def get_family(model_type: str) -> Family:
  """The family for an HF ``model_type``; a clear error naming the supported ones."""
  if model_type not in FAMILIES:
    supported = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for _, f in FAMILIES.items())
    raise UnsupportedCheckpointError(
        f"unknown architecture: model_type={model_type!r}; supported: {supported}")
  return FAMILIES.get(model_type)


def family_for(cfg: ModelConfig) -> Family:
  """The family whose checkpoint layout ``cfg`` (e.g. the native model) exports to."""
  if cfg.post_norms:
    return FAMILIES.get("gemma3_text" if cfg.qk_norm else "gemma2")
  if cfg.num_experts:
    return FAMILIES.get("qwen3_moe" if cfg.qk_norm else "qwen2_moe")
  if cfg.qk_norm:
    return FAMILIES.get("qwen3")
  if cfg.qkv_bias and not cfg.out_bias:
    return FAMILIES.get("qwen2")
  return FAMILIES.get("llama")


__all__ = [
    "FAMILIES",
    "Family",
    "TensorLayout",
    "TensorMap",
    "UnsupportedCheckpointError",
    "family_for",
    "get_family",
    "register",
]
