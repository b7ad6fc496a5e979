"""Per-layer key/value cache for incremental decoding."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jax_dora.model.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Keys and values, head-major: ``[n_layers, batch, n_kv_heads, max_seq_len, head_dim]``.

  Head-major so that decode attention reads a chunk of one layer as
  ``[batch, heads, chunk, head_dim]`` in place: the batched matmul over
  ``(batch, head)`` takes it without the transposed copy a
  ``[.., seq, heads, ..]`` layout costs every step (on XLA:CPU that copy made
  the read 2-3x slower; on a GPU it would double the KV traffic).

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
    shape = (cfg.n_layers, batch, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @property
  def max_seq_len(self) -> int:
    return self.k.shape[3]

  @classmethod
  def from_prefill(cls, new: "KVCache", max_seq_len: int,
                   dtype: jnp.dtype | str | None = None) -> "KVCache":
    """A cache whose rows hold ``new`` at positions ``0..T-1`` and zeros after.

    ``new``: ``[L,B,T,Hkv,D]`` entries from ``Transformer.prefill`` (prompt
    positions ``0..T-1``; right-padded positions are overwritten by decode
    before they are read). The cache dtype defaults to the entries'.
    """
    t = new.k.shape[2]
    if t > max_seq_len:
      raise ValueError(f"{t} prefill entries exceed max_seq_len={max_seq_len}")
    dtype = jnp.dtype(dtype if dtype is not None else new.k.dtype)
    pad = ((0, 0), (0, 0), (0, 0), (0, max_seq_len - t), (0, 0))

    def head_major(x: jax.Array) -> jax.Array:  # [L,B,T,Hkv,D] -> [L,B,Hkv,S,D]
      return jnp.pad(x.swapaxes(2, 3).astype(dtype), pad)

    return cls(k=head_major(new.k), v=head_major(new.v))

  def write_step(self, new: "KVCache", positions: jax.Array, rows: jax.Array) -> "KVCache":
    """Writes one decode step's entries in place.

    ``new``: ``[L,B,1,Hkv,D]`` entries from ``Transformer.decode``;
    ``positions[B]``: where each row's entry goes;
    ``rows[B]`` bool: rows to commit (the others, and positions past the end,
    are dropped). A scatter of ``B`` entries: with the cache donated, XLA
    updates it in place instead of copying it.
    """
    b = self.k.shape[1]
    pos = jnp.where(rows, positions, self.max_seq_len)  # out of range = dropped
    idx = (slice(None), jnp.arange(b), slice(None), pos)
    # Advanced indices around a slice put the row axis first: [B, L, Hkv, D].
    return KVCache(
        k=self.k.at[idx].set(new.k[:, :, 0].swapaxes(0, 1).astype(self.k.dtype), mode="drop"),
        v=self.v.at[idx].set(new.v[:, :, 0].swapaxes(0, 1).astype(self.v.dtype), mode="drop"),
    )
