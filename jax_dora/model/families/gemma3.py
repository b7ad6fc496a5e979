"""Gemma 3 text (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): Gemma 2's block with
QK-norm instead of attention soft-capping, and separate RoPE for local layers
(``rope_local_base_freq``, unscaled) and global layers (``rope_theta``, with the config's
scaling, e.g. linear x8 on the 4B+ models)."""

from __future__ import annotations

from typing import Any

from jax_dora.model.config import ModelConfig
from jax_dora.model.families import base


def _from_hf(hf: Any) -> dict[str, Any]:
  params = dict(getattr(hf, "rope_parameters", None) or {})
  global_rope = dict(params.get("full_attention") or {})
  local_rope = dict(params.get("sliding_attention") or {})
  if local_rope.get("rope_type", "default") != "default":
    raise base.UnsupportedCheckpointError(
        f"local layers' RoPE {local_rope}: only the default (unscaled) RoPE is implemented there")
  out = dict(base.gemma_from_hf(hf), **base.rope_from_parameters(
      global_rope, theta=getattr(hf, "rope_theta", None) or 1_000_000.0))
  # transformers' Gemma 3 attention applies no score soft-capping (QK-norm replaced it),
  # whatever attn_logit_softcapping says; the oracle is what it computes.
  out.update(qk_norm=True, attn_logit_softcap=0.0,
             rope_local_theta=float(local_rope.get("rope_theta")
                                    or getattr(hf, "rope_local_base_freq", None) or 10_000.0))
  return out


def _to_hf(cfg: ModelConfig) -> dict[str, Any]:
  if not cfg.qk_norm or cfg.attn_logit_softcap:
    raise base.UnsupportedCheckpointError(
        "a Gemma 3 checkpoint has QK-norm and no attention soft-capping")
  local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
  return dict(base.gemma_to_hf(cfg), rope_parameters={
      "full_attention": base.rope_to_parameters(cfg), "sliding_attention": local})


FAMILY = base.Family(
    name="gemma3_text",
    architectures=("Gemma3ForCausalLM",),
    from_hf=_from_hf,
    to_hf=_to_hf,
    tensors=base.llama_style_tensors,
    ignored=base.llama_style_ignored,
)
