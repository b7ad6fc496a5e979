"""Per-layer key/value cache for incremental decoding."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jax_dora.model.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Keys and values, ``[n_layers, batch, max_seq_len, n_kv_heads, head_dim]``.

  Entries are indexed by *absolute* token position, so rows of one batch can
  sit at different positions (continuous batching) and a slot can be reused by
  simply overwriting it: the attention mask only ever reads ``j <= position``.
  Keys are stored post-RoPE so decode never re-rotates the cache.
  """

  k: jax.Array
  v: jax.Array

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, dtype: jnp.dtype | str | None = None) -> "KVCache":
    dtype = jnp.dtype(dtype if dtype is not None else cfg.dtype)
    shape = (cfg.n_layers, batch, cfg.max_seq_len, cfg.n_kv_heads, cfg.head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @property
  def max_seq_len(self) -> int:
    return self.k.shape[2]

  def write_step(self, new: "KVCache", positions: jax.Array, rows: jax.Array) -> "KVCache":
    """Writes one decode step's entries in place.

    ``new``: ``[L,B,1,Hkv,D]`` entries from ``Transformer(...,
    defer_cache_write=True)``; ``positions[B]``: where each row's entry goes;
    ``rows[B]`` bool: rows to commit (the others, and positions past the end,
    are dropped). A scatter of ``B`` entries: with the cache donated, XLA
    updates it in place instead of copying it.
    """
    b = self.k.shape[1]
    pos = jnp.where(rows, positions, self.k.shape[2])  # out of range = dropped
    idx = (slice(None), jnp.arange(b), pos)
    return KVCache(
        k=self.k.at[idx].set(new.k[:, :, 0].astype(self.k.dtype), mode="drop"),
        v=self.v.at[idx].set(new.v[:, :, 0].astype(self.v.dtype), mode="drop"),
    )
