"""Gemma 2 (``Gemma2ForCausalLM``): sandwich norms, GeGLU, soft-capped attention scores and
logits, alternating sliding-window (local) and global layers, one RoPE base."""

from __future__ import annotations

from typing import Any

from jax_dora.model.config import ModelConfig
from jax_dora.model.families import base


def _from_hf(hf: Any) -> dict[str, Any]:
  out = dict(base.gemma_from_hf(hf), **base.rope_fields(hf))
  out["attn_logit_softcap"] = float(getattr(hf, "attn_logit_softcapping", None) or 0.0)
  return out


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if cfg.qk_norm or cfg.rope_local_theta not in (0.0, cfg.rope_theta):
    raise base.UnsupportedCheckpointError(
        "a Gemma 2 checkpoint has no QK-norm and one RoPE base for local and global layers")
  return dict(base.gemma_to_hf(cfg), rope_parameters=base.rope_to_parameters(cfg),
              attn_logit_softcapping=cfg.attn_logit_softcap or None)


FAMILY = base.Family(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    from_hf=_from_hf,
    to_hf=_to_hf,
    tensors=base.llama_style_tensors,
    ignored=base.llama_style_ignored,
)
