"""What a model family is: a config.json mapping plus a tensor-name/layout map.

A family translates between a Hugging Face checkpoint and ``ModelConfig`` /
our parameter tree. The Llama, Qwen2 and Qwen3 checkpoints share one tensor
naming (``model.layers.{i}.self_attn.q_proj.weight`` ...), so they share
:func:`llama_style_tensors` and differ only in how ``config.json`` maps onto
``ModelConfig``. A new family is one module defining a :class:`Family` and
one ``register`` line in ``jax_dora.model.families``.

Layouts: HF stores linear layers as ``[out, in]``; we store ``[in, out]``
with the head axes split (``query/kernel [embed, heads, head_dim]``). A
:class:`TensorLayout` is "optionally transpose the 2-D HF tensor, then split
axes", which is invertible exactly (export is bit-exact) and lets the importer
read only the slice of the HF tensor each device needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_dora.model.config import ModelConfig

ParamPath = tuple[str, ...]


class UnsupportedCheckpointError(ValueError):
  """A checkpoint uses a feature (architecture, activation, RoPE type ...) we do not implement."""


@dataclasses.dataclass(frozen=True)
class TensorLayout:
  """How one of our params relates to its HF tensor.

  Attributes:
    shape: Our shape.
    groups: How many of our axes make up each axis of the (transposed) HF
      tensor, in order; e.g. ``query/kernel [D, H, K]`` from
      ``q_proj.weight [H*K, D]`` is ``groups=(1, 2), transpose=True``.
    transpose: Whether the HF tensor is transposed relative to ours (2-D only).
  """

  shape: tuple[int, ...]
  groups: tuple[int, ...]
  transpose: bool = False

  def __post_init__(self):
    if sum(self.groups) != len(self.shape) or any(g not in (1, 2) for g in self.groups):
      raise ValueError(f"bad layout groups {self.groups} for shape {self.shape}")

  @property
  def merged_shape(self) -> tuple[int, ...]:
    out, i = [], 0
    for g in self.groups:
      out.append(math.prod(self.shape[i:i + g]))
      i += g
    return tuple(out)

  @property
  def hf_shape(self) -> tuple[int, ...]:
    m = self.merged_shape
    return tuple(reversed(m)) if self.transpose else m

  def to_ours(self, hf: np.ndarray) -> np.ndarray:
    a = hf.T if self.transpose else hf
    return a.reshape(self.shape)

  def to_hf(self, ours: np.ndarray) -> np.ndarray:
    a = ours.reshape(self.merged_shape)
    return np.ascontiguousarray(a.T if self.transpose else a)

  def read_slice(self, read: Callable[[tuple[slice, ...]], np.ndarray],
                 index: Sequence[slice]) -> np.ndarray:
    """Our ``array[index]`` from an HF tensor, reading only the rows it needs.

    ``read(hf_index)`` returns ``hf_tensor[hf_index]`` (a lazy safetensors
    slice). A split axis ``(outer, inner)`` is read for whole ``inner``
    blocks of the requested ``outer`` range, then cut.
    """
    idx = [slice(*s.indices(n)[:2]) for s, n in zip(index, self.shape)]
    merged_idx, block_shape, post = [], [], []
    i = 0
    for g in self.groups:
      if g == 1:
        s = idx[i]
        merged_idx.append(s)
        block_shape.append(s.stop - s.start)
        post.append(slice(None))
      else:
        outer, inner = idx[i], idx[i + 1]
        n_inner = self.shape[i + 1]
        merged_idx.append(slice(outer.start * n_inner, outer.stop * n_inner))
        block_shape += [outer.stop - outer.start, n_inner]
        post += [slice(None), inner]
      i += g
    hf_idx = tuple(reversed(merged_idx)) if self.transpose else tuple(merged_idx)
    a = np.asarray(read(hf_idx))
    if self.transpose:
      a = a.T
    return a.reshape(block_shape)[tuple(post)]


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """One checkpoint tensor and where it lives in our params.

  ``index``: the checkpoint stores one tensor per expert
  (``mlp.experts.{e}.gate_proj.weight``) where we stack them on a leading
  ``expert`` axis; the tensor is ``param[index]`` (``layout`` describes that
  slice). ``None``: the tensor is the whole param.
  """

  hf_name: str
  path: ParamPath
  layout: TensorLayout
  index: int | None = None


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family.

  Attributes:
    name: Registry key (the HF ``model_type``).
    architectures: HF ``architectures`` entries it loads (first = exported).
    from_hf: HF config object -> ``ModelConfig`` keyword arguments (without
      the run-level ``max_seq_len`` / dtypes). Raises
      :class:`UnsupportedCheckpointError` for features we do not implement.
    to_hf: ``ModelConfig`` -> HF config keyword arguments (export of a model
      that did not come from a checkpoint).
    tensors: ``ModelConfig`` -> every tensor of the checkpoint.
    ignored: Checkpoint tensor names that may be present and are not
      parameters (e.g. cached RoPE buffers).
  """

  name: str
  architectures: tuple[str, ...]
  from_hf: Callable[[Any], dict[str, Any]]
  to_hf: Callable[[ModelConfig], dict[str, Any]]
  tensors: Callable[[ModelConfig], list[TensorMap]]
  ignored: Callable[[ModelConfig, str], bool] = lambda cfg, name: False


def _linear(cfg_shape: tuple[int, ...], groups: tuple[int, ...]) -> TensorLayout:
  return TensorLayout(cfg_shape, groups, transpose=True)


def moe_tensors(cfg: ModelConfig, layer: int) -> list[TensorMap]:
  """An MoE layer's feed-forward: the router, each expert's three projections and (Qwen2-MoE)
  the shared expert with its gate."""
  d, e, f = cfg.d_model, cfg.num_experts, cfg.moe_d_ff
  pre, us = f"model.layers.{layer}.mlp.", (f"layers_{layer}", "mlp")
  out = [TensorMap(pre + "gate.weight", (*us, "router", "kernel"), _linear((d, e), (1, 1)))]
  if cfg.shared_expert_d_ff:
    g = cfg.shared_expert_d_ff
    sh = pre + "shared_expert."
    out += [
        TensorMap(sh + "gate_proj.weight", (*us, "shared_expert", "wi_0", "kernel"),
                  _linear((d, g), (1, 1))),
        TensorMap(sh + "up_proj.weight", (*us, "shared_expert", "wi_1", "kernel"),
                  _linear((d, g), (1, 1))),
        TensorMap(sh + "down_proj.weight", (*us, "shared_expert", "wo", "kernel"),
                  _linear((g, d), (1, 1))),
        TensorMap(pre + "shared_expert_gate.weight", (*us, "shared_expert_gate", "kernel"),
                  _linear((d, 1), (1, 1))),
    ]
  for x in range(e):
    ex = f"{pre}experts.{x}."
    out += [
        TensorMap(ex + "gate_proj.weight", (*us, "wi_0"), _linear((d, f), (1, 1)), index=x),
        TensorMap(ex + "up_proj.weight", (*us, "wi_1"), _linear((d, f), (1, 1)), index=x),
        TensorMap(ex + "down_proj.weight", (*us, "wo"), _linear((f, d), (1, 1)), index=x),
    ]
  return out


def stacked_shapes(maps: Sequence[TensorMap]) -> dict[ParamPath, tuple[int, ...]]:
  """Each param's shape: a layout's, or ``(n,) + layout`` for ``n`` indexed tensors."""
  out: dict[ParamPath, tuple[int, ...]] = {}
  counts: dict[ParamPath, int] = {}
  for m in maps:
    if m.index is None:
      out[m.path] = m.layout.shape
    else:
      counts[m.path] = max(counts.get(m.path, 0), m.index + 1)
      out[m.path] = (counts[m.path], *m.layout.shape)
  return out


def llama_style_tensors(cfg: ModelConfig) -> list[TensorMap]:
  """The tensors of a Llama / Qwen2 / Qwen3 (-MoE) / Gemma 2 / Gemma 3 checkpoint for ``cfg``."""
  d, h, kvh, k, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                        cfg.vocab_size)
  out = [TensorMap("model.embed_tokens.weight", ("embed", "embedding"), TensorLayout((v, d), (1, 1)))]
  for i in range(cfg.n_layers):
    pre, us = f"model.layers.{i}.", f"layers_{i}"
    attn = pre + "self_attn."
    norm = TensorLayout((d,), (1,))
    out += [
        TensorMap(pre + "input_layernorm.weight", (us, "attn_norm", "scale"), norm),
        TensorMap(attn + "q_proj.weight", (us, "attn", "query", "kernel"), _linear((d, h, k), (1, 2))),
        TensorMap(attn + "k_proj.weight", (us, "attn", "key", "kernel"), _linear((d, kvh, k), (1, 2))),
        TensorMap(attn + "v_proj.weight", (us, "attn", "value", "kernel"), _linear((d, kvh, k), (1, 2))),
        TensorMap(attn + "o_proj.weight", (us, "attn", "out", "kernel"), _linear((h, k, d), (2, 1))),
    ]
    if cfg.post_norms:  # Gemma 2/3: four norms a block, named for where they sit
      out += [
          TensorMap(pre + "post_attention_layernorm.weight", (us, "post_attn_norm", "scale"), norm),
          TensorMap(pre + "pre_feedforward_layernorm.weight", (us, "mlp_norm", "scale"), norm),
          TensorMap(pre + "post_feedforward_layernorm.weight", (us, "post_mlp_norm", "scale"), norm),
      ]
    else:  # Llama / Qwen: the "post-attention" norm is the feed-forward's input norm
      out.append(TensorMap(pre + "post_attention_layernorm.weight", (us, "mlp_norm", "scale"), norm))
    if cfg.is_moe_layer(i):
      out += moe_tensors(cfg, i)
    else:
      out += [
          TensorMap(pre + "mlp.gate_proj.weight", (us, "mlp", "wi_0", "kernel"),
                    _linear((d, f), (1, 1))),
          TensorMap(pre + "mlp.up_proj.weight", (us, "mlp", "wi_1", "kernel"),
                    _linear((d, f), (1, 1))),
          TensorMap(pre + "mlp.down_proj.weight", (us, "mlp", "wo", "kernel"),
                    _linear((f, d), (1, 1))),
      ]
    if cfg.qkv_bias:
      out += [
          TensorMap(attn + "q_proj.bias", (us, "attn", "query", "bias"), TensorLayout((h, k), (2,))),
          TensorMap(attn + "k_proj.bias", (us, "attn", "key", "bias"), TensorLayout((kvh, k), (2,))),
          TensorMap(attn + "v_proj.bias", (us, "attn", "value", "bias"), TensorLayout((kvh, k), (2,))),
      ]
    if cfg.out_bias:
      out.append(TensorMap(attn + "o_proj.bias", (us, "attn", "out", "bias"), TensorLayout((d,), (1,))))
    if cfg.qk_norm:
      out += [
          TensorMap(attn + "q_norm.weight", (us, "attn", "query_norm", "scale"), TensorLayout((k,), (1,))),
          TensorMap(attn + "k_norm.weight", (us, "attn", "key_norm", "scale"), TensorLayout((k,), (1,))),
      ]
  out.append(TensorMap("model.norm.weight", ("final_norm", "scale"), TensorLayout((d,), (1,))))
  if not cfg.tie_embeddings:
    out.append(TensorMap("lm_head.weight", ("lm_head", "kernel"), _linear((d, v), (1, 1))))
  return out


def llama_style_ignored(cfg: ModelConfig, name: str) -> bool:
  """Buffers some exporters write, and a redundant head copy in tied checkpoints."""
  return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")


# ---------------------------------------------------------------- config.json
def rope_fields(hf: Any) -> dict[str, Any]:
  """RoPE settings from an HF config (transformers 5 ``rope_parameters`` or 4.x fields)."""
  params = dict(getattr(hf, "rope_parameters", None) or {})
  legacy = dict(getattr(hf, "rope_scaling", None) or {})
  theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
  return rope_from_parameters(params, legacy, theta)


def rope_from_parameters(params: dict[str, Any], legacy: dict[str, Any] | None = None,
                         theta: float | None = None) -> dict[str, Any]:
  """``ModelConfig`` RoPE fields of one ``rope_parameters`` dict (Gemma 3 has one per layer type)."""
  theta = params.get("rope_theta", theta)
  scaling = params if params.get("rope_type", "default") != "default" else dict(legacy or {})
  rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  out: dict[str, Any] = {"rope_theta": float(theta if theta is not None else 10000.0)}
  if rope_type == "default":
    return out
  if rope_type == "linear":
    out.update(rope_scaling="linear", rope_scaling_factor=float(scaling["factor"]))
    return out
  if rope_type != "llama3":
    raise UnsupportedCheckpointError(
        f"RoPE type {rope_type!r} is not supported (supported: default, llama3, linear)")
  out.update(
      rope_scaling="llama3",
      rope_scaling_factor=float(scaling["factor"]),
      rope_low_freq_factor=float(scaling["low_freq_factor"]),
      rope_high_freq_factor=float(scaling["high_freq_factor"]),
      rope_original_max_len=int(scaling["original_max_position_embeddings"]),
  )
  return out


def rope_to_parameters(cfg: ModelConfig) -> dict[str, Any]:
  """The inverse of :func:`rope_from_parameters` (a global layer's ``rope_parameters``)."""
  out: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling == "linear":
    out.update(rope_type="linear", factor=cfg.rope_scaling_factor)
  elif cfg.rope_scaling == "llama3":
    out.update(rope_type="llama3", factor=cfg.rope_scaling_factor,
               low_freq_factor=cfg.rope_low_freq_factor,
               high_freq_factor=cfg.rope_high_freq_factor,
               original_max_position_embeddings=cfg.rope_original_max_len)
  return out


def common_from_hf(hf: Any) -> dict[str, Any]:
  """Fields every Llama-style config shares; rejects what the decoder does not implement."""
  act = getattr(hf, "hidden_act", "silu")
  if act != "silu" or getattr(hf, "hidden_activation", None) not in (None, "silu"):
    raise UnsupportedCheckpointError(f"hidden_act={act!r}: only SwiGLU with silu is implemented")
  if getattr(hf, "mlp_bias", False):
    raise UnsupportedCheckpointError("mlp_bias=True is not implemented")
  if getattr(hf, "use_sliding_window", False):
    raise UnsupportedCheckpointError("sliding-window attention (use_sliding_window=True) is not implemented")
  heads = int(hf.num_attention_heads)
  head_dim = getattr(hf, "head_dim", None) or int(hf.hidden_size) // heads
  return dict(
      vocab_size=int(hf.vocab_size),
      d_model=int(hf.hidden_size),
      n_layers=int(hf.num_hidden_layers),
      n_heads=heads,
      n_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
      head_dim=int(head_dim),
      d_ff=int(hf.intermediate_size),
      norm_eps=float(hf.rms_norm_eps),
      tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
      **rope_fields(hf),
  )


def moe_from_hf(hf: Any) -> dict[str, Any]:
  """The mixture-of-experts fields Qwen3-MoE and Qwen2-MoE configs share."""
  experts = int(getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", 0) or 0)
  if experts < 1:
    raise UnsupportedCheckpointError(f"a {hf.model_type} config.json without num_experts")
  return dict(
      num_experts=experts,
      num_experts_per_tok=int(hf.num_experts_per_tok),
      moe_d_ff=int(hf.moe_intermediate_size),
      norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
      moe_layer_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
      mlp_only_layers=tuple(int(i) for i in (getattr(hf, "mlp_only_layers", None) or ())),
      router_aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0),
  )


def moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The inverse of :func:`moe_from_hf`."""
  return dict(
      num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
      moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.norm_topk_prob,
      decoder_sparse_step=cfg.moe_layer_step, mlp_only_layers=list(cfg.mlp_only_layers),
      router_aux_loss_coef=cfg.router_aux_loss_coef)


def shape_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The ``config.json`` shape fields every family writes alike."""
  return dict(
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model,
      num_hidden_layers=cfg.n_layers,
      num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim,
      intermediate_size=cfg.d_ff,
      rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=cfg.tie_embeddings,
  )


def common_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  out: dict[str, Any] = dict(
      shape_to_hf(cfg),
      hidden_act="silu",
      max_position_embeddings=max(cfg.max_seq_len, cfg.rope_original_max_len
                                  if cfg.rope_scaling else cfg.max_seq_len),
  )
  # The 4.x spelling: transformers 5 still accepts it (and converts it to
  # ``rope_parameters``), 4.x understands nothing else.
  out["rope_theta"] = cfg.rope_theta
  out["rope_scaling"] = None
  if cfg.rope_scaling:
    out["rope_scaling"] = {k: v for k, v in rope_to_parameters(cfg).items() if k != "rope_theta"}
  return out


# ---------------------------------------------------------------- Gemma 2 / 3
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)  # GeGLU with GELU's tanh approximation
LAYER_TYPES = ("full_attention", "sliding_attention")


def gemma_from_hf(hf: Any) -> dict[str, Any]:
  """The fields Gemma 2 and Gemma 3 text configs share; rejects what we do not implement.

  Sandwich norms with ``1 + w`` scales, embeddings times ``sqrt(hidden)``,
  ``query_pre_attn_scalar`` and the layer types (``sliding_attention`` ->
  ``local_layers``) are read here; RoPE and soft-capping differ by family.
  """
  act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
  if act not in GEMMA_ACTIVATIONS:
    raise UnsupportedCheckpointError(
        f"hidden_activation={act!r}: Gemma's GeGLU is implemented with {GEMMA_ACTIVATIONS}")
  if getattr(hf, "use_bidirectional_attention", False):
    raise UnsupportedCheckpointError("use_bidirectional_attention=True (an encoder) is not a causal LM")
  layers = int(hf.num_hidden_layers)
  types = list(getattr(hf, "layer_types", None) or ["full_attention"] * layers)
  unknown = sorted(set(types) - set(LAYER_TYPES))
  if unknown or len(types) != layers:
    raise UnsupportedCheckpointError(
        f"layer_types={types}: expected {layers} entries of {LAYER_TYPES}")
  local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
  window = int(getattr(hf, "sliding_window", None) or 0)
  if local and window < 1:
    raise UnsupportedCheckpointError(f"sliding-window layers {local} without a sliding_window")
  heads = int(hf.num_attention_heads)
  bias = bool(getattr(hf, "attention_bias", False))
  return dict(
      vocab_size=int(hf.vocab_size),
      d_model=int(hf.hidden_size),
      n_layers=layers,
      n_heads=heads,
      n_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
      head_dim=int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // heads),
      d_ff=int(hf.intermediate_size),
      norm_eps=float(hf.rms_norm_eps),
      tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
      qkv_bias=bias,
      out_bias=bias,
      mlp_activation="gelu_tanh",
      norm_scale_offset=1.0,
      post_norms=True,
      scale_embeddings=True,
      query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
      final_logit_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
      local_layers=local,
      sliding_window=window if local else 0,
  )


def _int_if_whole(x: float) -> int | float:
  return int(x) if float(x).is_integer() else float(x)


def gemma_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The inverse of :func:`gemma_from_hf` (RoPE and the families' extras aside)."""
  if not (cfg.post_norms and cfg.norm_scale_offset == 1.0 and cfg.scale_embeddings
          and cfg.mlp_activation == "gelu_tanh") or cfg.qkv_bias != cfg.out_bias or cfg.num_experts:
    raise UnsupportedCheckpointError(
        "a Gemma checkpoint has sandwich norms with 1 + w scales, scaled embeddings, GeGLU,"
        " q/k/v/o biases together or not at all, and no experts")
  return dict(
      shape_to_hf(cfg),
      attention_bias=cfg.qkv_bias,
      hidden_activation=GEMMA_ACTIVATIONS[0],
      # transformers' strict config wants an int (every released Gemma's is)
      query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
      final_logit_softcapping=cfg.final_logit_softcap or None,
      sliding_window=cfg.sliding_window or None,
      layer_types=[LAYER_TYPES[1] if cfg.layer_window(i) else LAYER_TYPES[0]
                   for i in range(cfg.n_layers)],
      max_position_embeddings=cfg.max_seq_len,
  )
