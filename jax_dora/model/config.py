"""Model hyper-parameters, for the tiny native model and for imported HF families.

One frozen, hashable ``ModelConfig`` describes every decoder we run: the
tiny character model of the CI path and the Llama 3 / Qwen2.5 / Qwen3
checkpoints imported from Hugging Face (``jax_dora.model.families`` maps a
``config.json`` onto it). It is closed over by jitted functions and used as a
static argument, so it must stay immutable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import ml_collections

# ROPE_SCALINGS, and ATTENTION_IMPLS: the kernels of the cache-free attention
# (jax_dora.model.transformer._attend); the config's model block owns both.
from jax_dora.config.model import (
    ATTENTION_IMPLS,
    MLP_ACTIVATIONS,
    MOE_IMPLS,
    ROPE_SCALINGS,
    ModelBlock,
)
from jax_dora.csv_fields import split_csv

# The defaults of the run config's model block (the tiny native model): one
# source, so the two cannot disagree again (max_seq_len was 128 here, 96 there).
_BLOCK = ModelBlock()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of the decoder-only transformer.

  Attributes:
    vocab_size: Rows of the embedding (HF checkpoints often pad it past the
      tokenizer's length; the extra ids are never sampled).
    d_model: Residual stream width (HF ``hidden_size``).
    n_layers: Transformer blocks.
    n_heads: Query heads.
    d_ff: Hidden width of the SwiGLU MLP (HF ``intermediate_size``).
    max_seq_len: Longest sequence (prompt + completion); sizes the KV cache.
      A run-level choice, not the checkpoint's ``max_position_embeddings``.
    n_kv_heads: Key/value heads (grouped-query attention); 0 = ``n_heads``.
      The KV cache holds ``n_kv_heads`` heads, not ``n_heads``.
    head_dim: Per-head width; 0 = ``d_model // n_heads``. Qwen3 sets it
      independently of ``d_model``.
    rope_theta: RoPE frequency base.
    rope_scaling: ``""`` (plain RoPE), ``"llama3"`` (Llama 3.1+ frequency
      scaling, parameters below) or ``"linear"`` (frequencies divided by
      ``rope_scaling_factor``, Gemma 3's global layers).
    rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor,
    rope_original_max_len: Llama-3 RoPE scaling parameters (HF
      ``rope_scaling`` dict).
    norm_eps: RMSNorm epsilon.
    qkv_bias: Biases on the q/k/v projections (Qwen2).
    out_bias: Bias on the attention output projection (Llama with
      ``attention_bias``).
    qk_norm: RMSNorm over ``head_dim`` on queries and keys before RoPE (Qwen3).
    tie_embeddings: The LM head is the transposed embedding.
    param_dtype: Dtype parameters are stored (and optimised) in.
    dtype: Activation and KV-cache dtype. Attention softmax, logits,
      log-probs and the loss are always float32.
    attention_impl: Kernel of the cache-free attention (training, prefill):
      ``"auto"`` (cuDNN flash attention on a GPU with 16-bit activations,
      XLA elsewhere), ``"xla"`` or ``"cudnn"``. A run choice like the dtypes.
    moe_impl: The experts' matmul: ``"ragged"`` (grouped, ``ragged_dot``),
      ``"dense"`` (every token through every expert) or ``"auto"`` (dense on
      CPU, ragged elsewhere). A run choice; results are the same.
    num_experts: Experts of a mixture-of-experts feed-forward (Qwen3-MoE);
      0 = every layer has the dense SwiGLU MLP.
    num_experts_per_tok: Experts each token is routed to (top-k, dropless).
    moe_d_ff: Hidden width of one expert (HF ``moe_intermediate_size``).
    norm_topk_prob: Renormalise the top-k router probabilities to sum to 1.
    moe_layer_step: Every this many layers is MoE (HF ``decoder_sparse_step``).
    mlp_only_layers: Layers that keep the dense MLP (``d_ff``) anyway.
    router_aux_loss_coef: The checkpoint's load-balancing loss coefficient
      (the learner's default for ``learner.moe_aux_loss_coef``).
    shared_expert_d_ff: Width of Qwen2-MoE's shared expert, a dense SwiGLU
      every token passes through, scaled by a sigmoid gate; 0 = none.
    mlp_activation: The gated MLP's activation: ``"silu"`` (SwiGLU) or
      ``"gelu_tanh"`` (GeGLU with the tanh-approximated GELU, Gemma).
    norm_scale_offset: RMSNorm multiplies by ``offset + scale``; Gemma's
      ``1 + w`` (scales initialised at 0, the product in float32) is 1.0.
    post_norms: Gemma 2/3's sandwich norms: the attention and feed-forward
      outputs are RMS-normed before their residual adds.
    scale_embeddings: Embeddings times ``sqrt(d_model)`` (rounded to the
      parameter dtype, as Gemma's checkpoints were trained).
    query_pre_attn_scalar: Scores are scaled by ``this ** -0.5``; 0 = ``head_dim``.
    attn_logit_softcap, final_logit_softcap: ``cap * tanh(x / cap)`` on the
      attention scores / the output logits (Gemma 2); 0 = off.
    sliding_window: A local layer's query attends to at most this many
      positions, its own included (keys ``j > i - window``, Hugging Face's
      rule); 0 = no local layers.
    local_layers: Indices of the sliding-window layers; the others are global.
    rope_local_theta: RoPE base of local layers (Gemma 3); 0 = ``rope_theta``.
      RoPE scaling applies to global layers only.
  """

  vocab_size: int
  d_model: int = _BLOCK.d_model
  n_layers: int = _BLOCK.n_layers
  n_heads: int = _BLOCK.n_heads
  d_ff: int = _BLOCK.d_ff
  max_seq_len: int = _BLOCK.max_seq_len
  n_kv_heads: int = _BLOCK.n_kv_heads
  head_dim: int = _BLOCK.head_dim
  rope_theta: float = _BLOCK.rope_theta
  rope_scaling: str = _BLOCK.rope_scaling
  rope_scaling_factor: float = _BLOCK.rope_scaling_factor
  rope_low_freq_factor: float = _BLOCK.rope_low_freq_factor
  rope_high_freq_factor: float = _BLOCK.rope_high_freq_factor
  rope_original_max_len: int = _BLOCK.rope_original_max_len
  norm_eps: float = _BLOCK.norm_eps
  qkv_bias: bool = _BLOCK.qkv_bias
  out_bias: bool = _BLOCK.out_bias
  qk_norm: bool = _BLOCK.qk_norm
  tie_embeddings: bool = _BLOCK.tie_embeddings
  param_dtype: str = _BLOCK.param_dtype
  dtype: str = _BLOCK.dtype
  attention_impl: str = _BLOCK.attention_impl
  moe_impl: str = _BLOCK.moe_impl
  num_experts: int = _BLOCK.num_experts
  num_experts_per_tok: int = _BLOCK.num_experts_per_tok
  moe_d_ff: int = _BLOCK.moe_d_ff
  norm_topk_prob: bool = _BLOCK.norm_topk_prob
  moe_layer_step: int = _BLOCK.moe_layer_step
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = _BLOCK.router_aux_loss_coef
  shared_expert_d_ff: int = _BLOCK.shared_expert_d_ff
  mlp_activation: str = _BLOCK.mlp_activation
  norm_scale_offset: float = _BLOCK.norm_scale_offset
  post_norms: bool = _BLOCK.post_norms
  scale_embeddings: bool = _BLOCK.scale_embeddings
  query_pre_attn_scalar: float = _BLOCK.query_pre_attn_scalar
  attn_logit_softcap: float = _BLOCK.attn_logit_softcap
  final_logit_softcap: float = _BLOCK.final_logit_softcap
  sliding_window: int = _BLOCK.sliding_window
  local_layers: tuple[int, ...] = ()
  rope_local_theta: float = _BLOCK.rope_local_theta

  def __post_init__(self):
    # A tuple of ints from a tuple, a list or the run config's comma-separated string.
    for name in ("mlp_only_layers", "local_layers"):
      object.__setattr__(self, name, tuple(split_csv(getattr(self, name), int)))
    # Resolve the "0 = derived" defaults once, so every reader sees numbers.
    if self.n_kv_heads == 0:
      object.__setattr__(self, "n_kv_heads", self.n_heads)
    if self.head_dim == 0:
      if self.n_heads <= 0 or self.d_model % self.n_heads:
        raise ValueError(
            f"d_model={self.d_model} not divisible by n_heads={self.n_heads}; set head_dim")
      object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
    # Fail at construction rather than deep inside a traced reshape.
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len",
                 "n_kv_heads", "head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.rope_scaling not in ROPE_SCALINGS:
      raise ValueError(f"rope_scaling={self.rope_scaling!r} is not one of {ROPE_SCALINGS}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
          f"model.attention_impl={self.attention_impl!r} is not one of {ATTENTION_IMPLS}")
    if self.moe_impl not in MOE_IMPLS:
      raise ValueError(f"model.moe_impl={self.moe_impl!r} is not one of {MOE_IMPLS}")
    for name in ("param_dtype", "dtype"):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError:
        raise ValueError(f"model.{name}={getattr(self, name)!r} is not a dtype name") from None
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(
          f"model.mlp_activation={self.mlp_activation!r} is not one of {MLP_ACTIVATIONS}")
    for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                 "rope_local_theta"):
      if getattr(self, name) < 0:
        raise ValueError(f"model.{name} must be >= 0 (0 = off / derived), got {getattr(self, name)}")
    if self.sliding_window < 0:
      raise ValueError(f"model.sliding_window must be >= 0, got {self.sliding_window}")
    bad = [i for i in self.local_layers if not 0 <= i < self.n_layers]
    if bad:
      raise ValueError(f"model.local_layers {bad} outside [0, n_layers={self.n_layers})")
    if self.local_layers and not self.sliding_window:
      raise ValueError(f"model.local_layers={self.local_layers} needs model.sliding_window > 0")
    if self.num_experts < 0:
      raise ValueError(f"model.num_experts must be >= 0, got {self.num_experts}")
    if self.num_experts:
      if not 1 <= self.num_experts_per_tok <= self.num_experts:
        raise ValueError(f"model.num_experts_per_tok={self.num_experts_per_tok} must be in"
                         f" [1, num_experts={self.num_experts}]")
      if self.mlp_activation != "silu":
        raise ValueError("the mixture-of-experts feed-forward is SwiGLU: mlp_activation must be silu")
      if self.moe_d_ff <= 0 or self.moe_layer_step < 1 or self.shared_expert_d_ff < 0:
        raise ValueError("an MoE model needs moe_d_ff > 0, moe_layer_step >= 1 and"
                         " shared_expert_d_ff >= 0")
      bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
      if bad:
        raise ValueError(f"model.mlp_only_layers {bad} outside [0, n_layers={self.n_layers})")

  def is_moe_layer(self, layer: int) -> bool:
    """Whether block ``layer`` has the mixture-of-experts feed-forward (transformers' rule)."""
    return (self.num_experts > 0 and layer not in self.mlp_only_layers
            and (layer + 1) % self.moe_layer_step == 0)

  def layer_window(self, layer: int) -> int:
    """Block ``layer``'s sliding window (positions a query may see, its own included); 0 = global."""
    return self.sliding_window if layer in self.local_layers else 0

  @property
  def attention_scale(self) -> float:
    """The factor on ``q . k``: ``query_pre_attn_scalar ** -0.5`` (Gemma) or ``head_dim ** -0.5``."""
    return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  @classmethod
  def field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}

  @classmethod
  def from_config_dict(
      cls, cfg: ml_collections.ConfigDict | dict[str, Any], vocab_size: int | None = None
  ) -> "ModelConfig":
    """Builds a config from the ``c.model`` block of the run config.

    Keys that are not architecture (``hf_path``) are ignored; ``None``
    values (placeholders of HF recipes) fall back to the dataclass default.
    The run config does not know the vocabulary of the native model (it is a
    property of the tokenizer), so ``vocab_size`` is normally passed as a
    keyword; an explicit keyword wins over a value in the dict.
    """
    d = dict(cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else cfg)
    d.pop("hf_path", None)
    d = {k: v for k, v in d.items() if v is not None}
    if vocab_size is not None:
      d["vocab_size"] = vocab_size
    if "vocab_size" not in d:
      raise ValueError("vocab_size missing: pass it as a keyword (tokenizer.vocab_size)")
    unknown = set(d) - cls.field_names()
    if unknown:
      raise ValueError(f"unknown model config keys: {sorted(unknown)}")
    return cls(**d)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)
