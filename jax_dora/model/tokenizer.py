"""A fixed character-level tokenizer.

Character vocabularies keep the toy tasks (arithmetic, sorting, ...) exactly
representable, need no downloads, and make every rollout server and the
learner agree on ids by construction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from jetstream.engine import tokenizer_api

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3

# Order is part of the checkpoint format: never reorder, only append.
CHARSET = "0123456789" "abcdefghijklmnopqrstuvwxyz" " +-*=,:;()[]<>?!."


class CharTokenizer(tokenizer_api.Tokenizer):
  """Maps each character of ``CHARSET`` to one id after PAD/BOS/EOS."""

  def __init__(self, charset: str = CHARSET):
    if len(set(charset)) != len(charset):
      raise ValueError("charset has duplicate characters")
    self._charset = charset
    self._char_to_id = {c: i + NUM_SPECIAL for i, c in enumerate(charset)}

  @property
  def vocab_size(self) -> int:
    return NUM_SPECIAL + len(self._charset)

  @property
  def pad_id(self) -> int:
    return PAD_ID

  @property
  def eos_id(self) -> int:
    return EOS_ID

  @property
  def bos_id(self) -> int:
    return BOS_ID

  def encode_ids(self, s: str) -> np.ndarray:
    """Encodes ``s`` without BOS/EOS or padding; raises on unknown chars."""
    out = np.empty((len(s),), np.int32)
    for i, c in enumerate(s):
      try:
        out[i] = self._char_to_id[c]
      except KeyError:
        raise ValueError(f"character {c!r} (position {i}) is not in the tokenizer charset") from None
    return out

  def encode(
      self,
      s: str,
      *,
      is_bos: bool = False,
      max_prefill_length: int | None = None,
      jax_padding: Any = None,
  ) -> tuple[np.ndarray, int]:
    """JetStream ``Tokenizer.encode``: returns ``(tokens, true_length)``.

    Args:
      s: Text to encode.
      is_bos: Prepend BOS.
      max_prefill_length: If set, right-pad with PAD to exactly this length
        (prefill buckets are static shapes); longer inputs raise ValueError.
      jax_padding: Accepted for JetStream call-site compatibility and ignored;
        the result is always a numpy array.

    Returns:
      int32 tokens and the number of non-pad tokens.
    """
    del jax_padding
    ids = self.encode_ids(s)
    if is_bos:
      ids = np.concatenate([np.array([BOS_ID], np.int32), ids])
    true_length = int(ids.shape[0])
    if max_prefill_length is not None:
      if true_length > max_prefill_length:
        raise ValueError(
            f"encoded length {true_length} exceeds max_prefill_length={max_prefill_length}"
        )
      ids = np.pad(ids, (0, max_prefill_length - true_length), constant_values=PAD_ID)
    return ids, true_length

  def decode(self, token_ids: Iterable[int] | np.ndarray, **kwargs) -> str:
    """Decodes until the first EOS, skipping PAD and BOS."""
    del kwargs
    chars = []
    for t in np.asarray(token_ids, dtype=np.int64).reshape(-1).tolist():
      if t == EOS_ID:
        break
      if t in (PAD_ID, BOS_ID):
        continue
      k = t - NUM_SPECIAL
      if not 0 <= k < len(self._charset):
        raise ValueError(f"token id {t} outside vocabulary of size {self.vocab_size}")
      chars.append(self._charset[k])
    return "".join(chars)
