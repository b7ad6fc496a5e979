"""Rotary position embedding, with Llama-3 and linear frequency scaling.

The frequencies are computed once on the host in float32 exactly as Hugging
Face's ``_compute_default_rope_parameters`` / ``_compute_llama3_parameters``
do, so an imported checkpoint sees the same rotation it was trained with.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_dora.model.config import ModelConfig


@functools.lru_cache(maxsize=64)
def _inv_freq_cached(cfg: ModelConfig, local: bool) -> np.ndarray:
  d = cfg.head_dim
  theta = (cfg.rope_local_theta or cfg.rope_theta) if local else cfg.rope_theta
  inv = (1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
         ).astype(np.float32)
  # Scaling stretches the long context of global layers; local (sliding-window)
  # layers never see far positions, so Gemma 3 keeps them unscaled.
  if not local and cfg.rope_scaling == "llama3":
    inv = _llama3_scale(inv, cfg)
  elif not local and cfg.rope_scaling == "linear":
    inv = (inv / np.float32(cfg.rope_scaling_factor)).astype(np.float32)
  inv.setflags(write=False)
  return inv


def _llama3_scale(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  """Llama 3.1 scaling: long wavelengths slowed by ``factor``, a smooth band between.

  Low frequencies (wavelength above ``original_max_len / low_freq_factor``)
  are divided by ``factor``; high ones (below ``original / high_freq_factor``)
  are kept; the band between interpolates linearly in ``original / wavelen``.
  """
  factor = np.float32(cfg.rope_scaling_factor)
  low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old = cfg.rope_original_max_len
  low_wavelen, high_wavelen = old / low, old / high
  wavelen = (2 * math.pi / inv_freq).astype(np.float32)
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
  smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
  smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def inv_frequencies(cfg: ModelConfig, local: bool = False) -> np.ndarray:
  """``[head_dim / 2]`` float32 inverse frequencies of a global (or ``local``) layer
  (read-only, cached per config)."""
  return _inv_freq_cached(cfg, bool(local))


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig,
               local: bool = False) -> jax.Array:
  """Rotary embedding on ``x[B,T,H,D]`` at absolute ``positions[B,T]``.

  Half-split layout (GPT-NeoX / Hugging Face ``rotate_half``). Computed in
  float32 so a cached key and a freshly computed one at the same position
  are identical.
  """
  d = x.shape[-1]
  freq = jnp.asarray(inv_frequencies(cfg, local))  # [D/2]
  angle = positions.astype(jnp.float32)[..., None] * freq  # [B,T,D/2]
  sin = jnp.sin(angle)[:, :, None, :]
  cos = jnp.cos(angle)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
