"""Every static shape the rollout engine compiles for, and which one a step uses.

The engine's device programs have fixed shapes so each compiles once
(``EnginePrograms.warmup`` compiles all of them before serving). Four tables
decide those shapes; this module owns them and answers, on the host, "which
program for this step" from what the driver knows (a context's length, the
highest slot position, a version's row count):

* prefill lengths: a context is right-padded to the smallest that holds it
  (fresh prompts fit the first; resumed and multi-turn contexts the longer ones);
* prefill rows: how many distinct contexts one batched prefill call holds at
  a padded length (powers of four up to the slots, capped by
  ``prefill_batch_tokens``);
* decode lengths: the static attention bound of a decode step (doubling up to
  ``max_seq_len``): a step reads the cache entries below its bound only;
* pass rows: the gathered row count of one version's pass in a multi-version
  step (``slots/8, /4, /2``, then a full pass).

Pure host code (no JAX): a table change is a change here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def smallest_holding(buckets: Sequence[int], n: int) -> int | None:
  """The first of the ascending ``buckets`` that is ``>= n`` (None: none is)."""
  return next((b for b in buckets if n <= b), None)


def decode_length_buckets(max_seq_len: int, smallest: int = 0) -> tuple[int, ...]:
  """Static attention bounds of decode steps: doubling up to ``max_seq_len``.

  Starts at ``max(128, max_seq_len // 32)`` unless ``smallest`` is given, so
  a cache has at most six buckets (six compiled programs per pass shape; one
  for caches of up to 160 entries) and a step past the first bucket reads at
  most 2.5x the entries its longest live row needs (the last doubling is
  dropped when ``max_seq_len`` is within 1.25x of it).
  """
  b = max(1, min(int(smallest) or max(128, max_seq_len // 32), max_seq_len))
  out = []
  while b < max_seq_len:
    out.append(b)
    b *= 2
  if out and max_seq_len <= 1.25 * out[-1]:
    out.pop()  # 2048 next to 2400: a program of its own for a <= 25% shorter read
  out.append(max_seq_len)
  return tuple(out)


def prefill_buckets(max_prefill_length: int, max_seq_len: int) -> tuple[int, ...]:
  """Padded prefill lengths: ``max_prefill_length`` doubling up to ``max_seq_len``.

  Fresh prompts fit the first bucket; resumed requests (prompt + an
  interrupted completion) need the longer ones. Few buckets = few compiles.
  """
  out = []
  b = max(1, min(max_prefill_length, max_seq_len))
  while b < max_seq_len:
    out.append(b)
    b *= 2
  out.append(max_seq_len)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class ProgramBuckets:
  """The four bucket tables of one engine (see the module docstring)."""

  num_slots: int
  max_seq_len: int
  prefill_lengths: tuple[int, ...]
  decode_lengths: tuple[int, ...]
  pass_rows: tuple[int, ...]
  prefill_batch_tokens: int

  @classmethod
  def build(cls, *, num_slots: int, max_prefill_length: int, max_seq_len: int,
            prefill_batch_tokens: int, length_buckets: Sequence[int] = (),
            dense_decode: bool = False) -> ProgramBuckets:
    """The tables for an engine; ``length_buckets`` overrides the decode lengths
    (``max_seq_len`` is always the last); ``dense_decode`` attention reads the
    whole cache whatever the bound, so it has one decode length."""
    s = int(max_seq_len)
    if dense_decode:
      decode = (s,)
    elif length_buckets:
      decode = tuple(sorted({min(int(b), s) for b in length_buckets} | {s}))
    else:
      decode = decode_length_buckets(s)
    if decode[0] < 1:
      raise ValueError(f"length_buckets {tuple(length_buckets)} must be >= 1")
    n = int(num_slots)
    pass_rows = tuple(sorted({max(1, n // d) for d in (8, 4, 2)} - {n})) + (n,)
    return cls(n, s, prefill_buckets(int(max_prefill_length), s), decode, pass_rows,
               int(prefill_batch_tokens))

  def prefill_length(self, n: int) -> int:
    """The padded length of an ``n``-token context."""
    b = smallest_holding(self.prefill_lengths, n)
    if b is None:
      raise ValueError(f"{n} tokens exceed max_seq_len={self.max_seq_len}")
    return b

  def prefill_rows(self, length: int) -> tuple[int, ...]:
    """Row buckets of a batched prefill at padded length ``length``.

    Powers of four up to the slots (few compiles: a round's distinct contexts
    are few when GRPO groups share prompts, and padded rows cost prefill, not
    decode), capped so one call holds at most ``prefill_batch_tokens`` tokens
    (a long resumed context prefills alone rather than padding a batch of
    short prompts to its length).
    """
    cap = max(1, min(self.num_slots, self.prefill_batch_tokens // max(1, int(length))))
    out, u = [], 1
    while u < cap:
      out.append(u)
      u *= 4
    out.append(cap)
    return tuple(sorted(set(out)))

  def decode_length(self, max_position: int) -> int:
    """The attention bound of a step whose highest active position is ``max_position``."""
    # Positions never pass max_seq_len, the last bucket.
    return smallest_holding(self.decode_lengths, max_position) or self.decode_lengths[-1]

  def pass_size(self, rows: int) -> int:
    """The gathered row count of a version's pass over ``rows`` slots (all: a full pass)."""
    return smallest_holding(self.pass_rows, rows) or self.num_slots
