"""The tokenizer contract of jax-dora, and the fixed character-level tokenizer.

Every tokenizer is a JetStream ``tokenizer_api.Tokenizer`` plus what RL
needs on top: how a *prompt* becomes ids (BOS, chat template), which ids stop
a completion (``stop_tokens``) and which ids must never be sampled
(``suppressed_ids``: padding, BOS, special tokens that are not stop tokens).
``CharTokenizer`` is the native tiny model's; ``jax_dora.model.hf_tokenizer``
wraps a Hugging Face tokenizer behind the same contract.

Character vocabularies keep the toy tasks (arithmetic, sorting, ...) exactly
representable, need no downloads, and make every rollout server and the
learner agree on ids by construction.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

import numpy as np

from jax_dora.jetstream_api import tokenizer_api

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3

# Order is part of the checkpoint format: never reorder, only append.
CHARSET = "0123456789" "abcdefghijklmnopqrstuvwxyz" " +-*=,:;()[]<>?!."


class PolicyTokenizer(tokenizer_api.Tokenizer):
  """JetStream's ``Tokenizer`` plus the prompt / stop / suppression rules RL needs."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """Ids the tokenizer can produce (a model's embedding may have more rows)."""

  @abc.abstractmethod
  def encode_ids(self, s: str) -> np.ndarray:
    """int32 ids of ``s`` alone: no BOS/EOS, no template, no padding."""

  def encode_text(self, s: str) -> np.ndarray:
    """int32 ids of untrusted text (a tool's output): every character stays text.

    ``encode_ids`` maps a special token's string (``<|im_end|>``) to its id, as a
    prompt or an SFT target written by us may want; text a tool or model-written
    program printed must not forge a stop token or a turn boundary, so a
    tokenizer whose special tokens are reachable from text overrides this to
    split them into ordinary pieces. The default suits a vocabulary whose
    special ids no string reaches (the character tokenizer's).
    """
    return self.encode_ids(s)

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
      s: Text to encode (plain: no prompt template).
      is_bos: Prepend BOS (when the tokenizer has one).
      max_prefill_length: If set, right-pad with PAD to exactly this length
        (prefill buckets are static shapes); longer inputs raise ValueError.
      jax_padding: Accepted for JetStream call-site compatibility and ignored;
        the result is always a numpy array.

    Returns:
      int32 tokens and the number of non-pad tokens.
    """
    del jax_padding
    ids = np.asarray(self.encode_ids(s), np.int32)
    if is_bos and self.bos_id >= 0:
      ids = np.concatenate([np.array([self.bos_id], np.int32), ids])
    true_length = int(ids.shape[0])
    if max_prefill_length is not None:
      if true_length > max_prefill_length:
        raise ValueError(
            f"encoded length {true_length} exceeds max_prefill_length={max_prefill_length}"
        )
      ids = np.pad(ids, (0, max_prefill_length - true_length), constant_values=self.pad_id)
    return ids, true_length

  @abc.abstractmethod
  def encode_prompt(self, text: str) -> np.ndarray:
    """int32 ids of ``text`` as the policy sees it as a prompt (BOS, chat template)."""

  @abc.abstractmethod
  def suppressed_ids(self, model_vocab_size: int) -> set[int]:
    """Ids of a ``model_vocab_size`` head that sampling must never produce."""

  @property
  def stop_tokens(self) -> set[int]:
    """Ids that end a completion (JetStream's default adds PAD; we never sample it)."""
    return {self.eos_id}


class CharTokenizer(PolicyTokenizer):
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

  def encode_prompt(self, text: str) -> np.ndarray:
    """``[BOS] + chars``: the prompt format the tiny model is trained on."""
    return self.encode(text, is_bos=True)[0]

  def suppressed_ids(self, model_vocab_size: int) -> set[int]:
    """PAD, BOS and any head rows past the charset: only characters and EOS are sampled."""
    return {PAD_ID, BOS_ID} | set(range(self.vocab_size, int(model_vocab_size)))

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
