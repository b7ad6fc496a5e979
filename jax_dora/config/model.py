"""``config.model``: the policy's architecture and dtypes."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, ConfigError, choice, field
from jax_dora.csv_fields import split_csv

ROPE_SCALINGS = ("", "llama3", "linear")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
MOE_IMPLS = ("auto", "ragged", "dense")
# Fields that are a run's choice even for a Hugging Face checkpoint (the
# others come from its config.json).
RUN_LEVEL_FIELDS = ("max_seq_len", "param_dtype", "dtype", "attention_impl", "moe_impl")


def check_dtype(block: str, name: str, value: str) -> None:
  """A dtype name JAX knows (``float32``, ``bfloat16``, ...)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  try:
    np.dtype(jnp.dtype(value))
  except TypeError:
    raise ConfigError(f"config.{block}.{name}={value!r} is not a dtype name") from None


@dataclasses.dataclass(frozen=True)
class ModelBlock(ConfigBlock):
  """The tiny native character model by default.

  A Hugging Face model sets ``hf_path`` (a local directory with config.json,
  safetensors and tokenizer files) and leaves the architecture fields unset
  (None, :func:`jax_dora.config.hf_model_config`): they come from
  config.json, and any value set must agree with it.
  """

  BLOCK = "model"

  hf_path: str = field("", "Local Hugging Face checkpoint directory; \"\" = the native tiny model.")
  d_model: int | None = field(64, "Hidden size.")
  n_layers: int | None = field(2, "Transformer blocks.")
  n_heads: int | None = field(4, "Query heads.")
  n_kv_heads: int | None = field(0, "Key/value heads (GQA); 0 = n_heads.")
  head_dim: int | None = field(0, "Per-head size; 0 = d_model // n_heads.")
  d_ff: int | None = field(256, "MLP hidden size.")
  max_seq_len: int = field(96, "KV cache and training row length: always a run choice.")
  rope_theta: float | None = field(10000.0, "RoPE base.")
  rope_scaling: str | None = field(
      "", "\"\", \"llama3\" or \"linear\" (positions divided by the factor); global layers only.")
  rope_scaling_factor: float | None = field(1.0, "RoPE scaling factor (llama3, linear).")
  rope_low_freq_factor: float | None = field(1.0, "Llama 3 RoPE low-frequency factor.")
  rope_high_freq_factor: float | None = field(4.0, "Llama 3 RoPE high-frequency factor.")
  rope_original_max_len: int | None = field(8192, "Llama 3 RoPE original context length.")
  norm_eps: float | None = field(1e-6, "RMSNorm epsilon.")
  qkv_bias: bool | None = field(False, "Biases on q/k/v projections (Qwen2).")
  out_bias: bool | None = field(False, "Bias on the attention output projection.")
  qk_norm: bool | None = field(False, "RMSNorm on queries and keys (Qwen3).")
  tie_embeddings: bool | None = field(False, "Output head shares the embedding matrix.")
  param_dtype: str = field(
      "float32", "Dtype of params and Adam moments. Softmax, logits, log-probs and the loss"
      " are always float32; bfloat16 dtype + float32 params is the usual accelerator setting.")
  dtype: str = field("float32", "Dtype of activations and the KV cache.")
  attention_impl: str = field(
      "auto", "Training / prefill attention kernel: auto = cuDNN flash attention on a GPU"
      " with bfloat16/float16 activations, XLA elsewhere; xla or cudnn to force one.")
  moe_impl: str = field(
      "auto", "MoE experts' matmul: auto = dense on CPU (XLA:CPU expands ragged_dot per expert,"
      " so every token through every expert is faster there), ragged elsewhere; ragged"
      " (jax.lax.ragged_dot over tokens sorted by expert) or dense to force one.")
  num_experts: int | None = field(
      0, "Mixture-of-experts feed-forward with this many experts (Qwen3-MoE); 0 = dense.")
  num_experts_per_tok: int | None = field(0, "Experts per token (top-k routing, no dropping).")
  moe_d_ff: int | None = field(0, "Hidden size of one expert (HF moe_intermediate_size).")
  norm_topk_prob: bool | None = field(False, "Renormalise the top-k router probabilities.")
  moe_layer_step: int | None = field(
      1, "Every this many layers is MoE (HF decoder_sparse_step).")
  mlp_only_layers: str | None = field(
      "", "Comma-separated layer indices that keep the dense MLP in an MoE model.")
  router_aux_loss_coef: float | None = field(
      0.0, "Load-balancing loss coefficient of the checkpoint (learner.moe_aux_loss_coef=-1"
      " uses it).")
  shared_expert_d_ff: int | None = field(
      0, "Width of Qwen2-MoE's sigmoid-gated shared expert; 0 = none.")
  mlp_activation: str | None = field(
      "silu", "Gated MLP activation: silu (SwiGLU) or gelu_tanh (Gemma's GeGLU).")
  norm_scale_offset: float | None = field(
      0.0, "RMSNorm multiplies by (offset + scale); Gemma's 1 + w is 1.0 (zero-initialised"
      " scales, computed in float32).")
  post_norms: bool | None = field(
      False, "Gemma 2/3 sandwich norms: an RMSNorm on the attention and feed-forward outputs"
      " before each residual add.")
  scale_embeddings: bool | None = field(
      False, "Multiply embeddings by sqrt(d_model) (Gemma).")
  query_pre_attn_scalar: float | None = field(
      0.0, "Attention scores are scaled by this ** -0.5 (Gemma); 0 = head_dim.")
  attn_logit_softcap: float | None = field(
      0.0, "Attention scores pass through cap * tanh(s / cap) (Gemma 2); 0 = off.")
  final_logit_softcap: float | None = field(
      0.0, "Output logits pass through cap * tanh(logits / cap) (Gemma 2); 0 = off.")
  sliding_window: int | None = field(
      0, "Local layers attend to at most this many positions (their own included); 0 = none.")
  local_layers: str | None = field(
      "", "Comma-separated indices of the sliding-window (local) layers; the rest are global.")
  rope_local_theta: float | None = field(
      0.0, "RoPE base of local layers (Gemma 3's rope_local_base_freq); 0 = rope_theta.")

  def __post_init__(self):
    if self.rope_scaling is not None:
      choice(self.BLOCK, "rope_scaling", self.rope_scaling, ROPE_SCALINGS)
    choice(self.BLOCK, "attention_impl", self.attention_impl, ATTENTION_IMPLS)
    choice(self.BLOCK, "moe_impl", self.moe_impl, MOE_IMPLS)
    if self.mlp_activation is not None:
      choice(self.BLOCK, "mlp_activation", self.mlp_activation, MLP_ACTIVATIONS)
    if self.max_seq_len < 2:
      self.fail("max_seq_len", "must be >= 2")
    for name in ("param_dtype", "dtype"):
      check_dtype(self.BLOCK, name, getattr(self, name))

  @property
  def architecture(self) -> dict[str, object]:
    """The architecture fields that are set (not None), for ``ModelConfig``."""
    out = {k: v for k, v in self.to_dict().items() if k != "hf_path" and v is not None}
    for name in ("mlp_only_layers", "local_layers"):  # ModelConfig's form, compared to a checkpoint's
      if name in out:
        out[name] = tuple(split_csv(out[name], int))
    return out

  def unset_fields(self) -> list[str]:
    return [k for k, v in self.to_dict().items() if v is None]
