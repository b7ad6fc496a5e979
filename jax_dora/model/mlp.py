"""The dense SwiGLU feed-forward (Llama / Qwen MLP), shared by the block and MoE's shared expert."""

from __future__ import annotations

import flax.linen as nn
import jax

from jax_dora.model.config import ModelConfig


class MLP(nn.Module):
  """SwiGLU feed-forward: ``wo(silu(wi_0 x) * wi_1 x)``; ``d_ff`` overrides the
  config's width (Qwen2-MoE's shared expert)."""

  cfg: ModelConfig
  d_ff: int = 0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    init = nn.initializers.lecun_normal()

    def dense(features: int, axes: tuple[str, str], name: str) -> nn.Dense:
      return nn.Dense(
          features,
          use_bias=False,
          dtype=cfg.jnp_dtype,
          param_dtype=cfg.jnp_param_dtype,
          kernel_init=nn.with_logical_partitioning(init, axes),
          name=name,
      )

    width = self.d_ff or cfg.d_ff
    h = nn.silu(dense(width, ("embed", "mlp"), "wi_0")(x)) * dense(
        width, ("embed", "mlp"), "wi_1"
    )(x)
    return dense(cfg.d_model, ("mlp", "embed"), "wo")(h)
