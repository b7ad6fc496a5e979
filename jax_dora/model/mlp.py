"""The dense gated feed-forward (SwiGLU of Llama / Qwen, GeGLU of Gemma), shared by the block
and MoE's shared expert."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax

from jax_dora.model.config import ModelConfig


class MLP(nn.Module):
  """Gated feed-forward: ``wo(act(wi_0 x) * wi_1 x)``, ``act`` the config's
  ``mlp_activation`` (silu, or GELU's tanh approximation for Gemma: the same
  formula as ``gelu_pytorch_tanh``); ``d_ff`` overrides the config's width
  (Qwen2-MoE's shared expert)."""

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
    act = nn.silu if cfg.mlp_activation == "silu" else functools.partial(nn.gelu, approximate=True)
    h = act(dense(width, ("embed", "mlp"), "wi_0")(x)) * dense(
        width, ("embed", "mlp"), "wi_1"
    )(x)
    return dense(cfg.d_model, ("mlp", "embed"), "wo")(h)
