"""Model hyper-parameters.

``ModelConfig`` is frozen and hashable so it can be closed over by jitted
functions and used as a static argument without retracing surprises.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import ml_collections


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape of the decoder-only transformer.

  Attributes:
    vocab_size: Number of token ids (normally ``CharTokenizer().vocab_size``).
    d_model: Residual stream width.
    n_layers: Number of transformer blocks.
    n_heads: Number of attention heads; must divide ``d_model``.
    d_ff: Hidden width of the SwiGLU MLP.
    max_seq_len: Longest sequence (prompt + completion); sizes the KV cache.
    rope_base: RoPE frequency base.
    dtype: Activation / KV-cache dtype name (params are always float32).
  """

  vocab_size: int
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  d_ff: int = 256
  max_seq_len: int = 128
  rope_base: float = 10000.0
  dtype: str = "float32"

  def __post_init__(self):
    # Fail at construction rather than deep inside a traced reshape.
    if self.vocab_size <= 0:
      raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    jnp.dtype(self.dtype)  # Raises TypeError on an unknown dtype name.

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @classmethod
  def from_config_dict(
      cls, cfg: ml_collections.ConfigDict | dict[str, Any], vocab_size: int | None = None
  ) -> "ModelConfig":
    """Builds a config from the ``c.model`` block of the run config.

    The run config does not know the vocabulary (it is a property of the
    tokenizer), so ``vocab_size`` is normally passed as a keyword; an explicit
    keyword wins over a value in the dict.
    """
    d = dict(cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else cfg)
    if vocab_size is not None:
      d["vocab_size"] = vocab_size
    if "vocab_size" not in d:
      raise ValueError("vocab_size missing: pass it as a keyword (tokenizer.vocab_size)")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"unknown model config keys: {sorted(unknown)}")
    return cls(**d)
