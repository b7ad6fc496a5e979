"""Supervised fine-tuning rows: prompt + target tokens, the loss on the target only.

The SFT data path reads the same files and formats as RL prompts
(``jax_dora.data.files``, ``data.format``), applies the same prompt
rendering (``data.prompt_template=chat``: the tokenizer's chat template with
the assistant header appended, exactly what a rollout is prefilled with),
and appends the target's tokens and the tokenizer's EOS, the stop id a
completion ends on. Prompt tokens are masked out of the loss.

Tool-integrated traces: a target may hold tool observations (the text a tool
returned, in its call format's wrapper, e.g. a fenced ``output`` block). Those
are what the environment writes, not the model: given ``observation_spans``
(the run's :class:`~jax_dora.orchestrator.multiturn.CallFormat`), each
observation is tokenised alone, exactly as a multi-turn rollout appends it,
and masked out of the loss like the prompt (ReTool, verl's multi-turn SFT:
the model learns to call and to read, never to predict a tool's output).

Bad rows are handled like the RL side's: a row without the prompt or target
field is skipped with a logged count (``data.on_bad_row=error`` stops
instead), and so is a row whose prompt + target exceed ``model.max_seq_len``
tokens (counted under its own reason, never silently cut: a truncated target
would teach the model to stop mid-answer).

The training stream is a Grain ``MapDataset`` (shuffle per epoch, repeat,
batch), so its position is a small checkpointable state like the RL prompt
stream's: a resumed SFT run continues with exactly the batches the killed
one would have trained next.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grain
import numpy as np

from jax_dora.config.run import RunConfig
from jax_dora.csv_fields import split_csv
from jax_dora.data.files import DatasetError, RecordTable, read_records
from jax_dora.data.formats import get_format

_log = logging.getLogger(__name__)

OVERLONG = "prompt + target longer than model.max_seq_len"


# Character spans ``[start, end)`` of the tool observations in a target text.
ObservationSpans = Callable[[str], Sequence[tuple[int, int]]]


class SftRow(NamedTuple):
  """One tokenised row: ``ids`` = prompt + target + EOS; the loss is on the target tokens
  outside ``context_spans`` (token ranges ``[start, end)`` of tool observations)."""

  ids: np.ndarray
  prompt_len: int
  context_spans: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass
class SftRows:
  """Tokenized rows: ``tokens[i]`` is prompt + target + EOS, ``prompt_lens[i]`` its prompt part,
  ``context_spans[i]`` its observations' token ranges (empty: no tool in the row)."""

  tokens: list[np.ndarray]
  prompt_lens: list[int]
  texts: list[str]
  skipped: dict[str, int]
  context_spans: list[tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=list)

  def __len__(self) -> int:
    return len(self.tokens)

  def __getitem__(self, i: int) -> SftRow:
    return SftRow(self.tokens[i], self.prompt_lens[i],
                  self.context_spans[i] if self.context_spans else ())

  def subset(self, indices: Sequence[int]) -> SftRows:
    """The rows at ``indices`` (in that order)."""
    return SftRows([self.tokens[i] for i in indices], [self.prompt_lens[i] for i in indices],
                   [self.texts[i] for i in indices], self.skipped,
                   [self.context_spans[i] for i in indices] if self.context_spans else [])


def read_sft_table(cfg: RunConfig, files: str) -> RecordTable:
  """The validated rows of ``files`` with ``config.sft.target_field`` as the answer field."""
  d = cfg.data
  fmt = get_format(d.format, d.prompt_field, cfg.sft.target_field or d.answer_field)
  return read_records(split_csv(files, str), fmt, d.on_bad_row)


def encode_target(tokenizer: Any, target: str, observation_spans: ObservationSpans | None,
                  offset: int = 0) -> tuple[np.ndarray, tuple[tuple[int, int], ...]]:
  """``target``'s ids and its observations' token ranges (shifted by ``offset``).

  Without ``observation_spans`` the target is one piece. With it, the text is
  cut at the observations and every piece is tokenised alone: the model's
  pieces as it would sample them (a turn ends at its stop string), each
  observation as a rollout appends it (``ToolLoop``: the wrapped text encoded
  on its own), so the SFT rows and the multi-turn rollouts hold the same ids.
  """
  if observation_spans is None:
    return np.asarray(tokenizer.encode_ids(target), np.int32), ()
  pieces: list[tuple[str, bool]] = []  # (text, is it an observation)
  at = 0
  for start, end in sorted(observation_spans(target)):
    pieces += [(target[at:start], False), (target[start:end], True)]
    at = end
  pieces.append((target[at:], False))
  ids: list[np.ndarray] = []
  spans: list[tuple[int, int]] = []
  n = offset
  for text, is_observation in pieces:
    encode = tokenizer.encode_text if is_observation else tokenizer.encode_ids
    part = np.asarray(encode(text) if text else [], np.int32)
    if is_observation:
      spans.append((n, n + len(part)))
    ids.append(part)
    n += len(part)
  return np.concatenate(ids).astype(np.int32), tuple(spans)


def tokenize_rows(table: RecordTable, tokenizer: Any, max_seq_len: int,
                  on_bad_row: str = "skip",
                  observation_spans: ObservationSpans | None = None) -> SftRows:
  """Prompt + target + EOS ids of every row that fits ``max_seq_len`` tokens.

  ``observation_spans``: finds tool observations in a target (the run's call
  format; None: no tools), which are tokenised alone and kept out of the loss.

  Raises:
    DatasetError: a row too long under ``on_bad_row="error"``, or no row fits.
  """
  tokens, prompt_lens, texts, contexts = [], [], [], []
  skipped = collections.Counter(table.skipped)
  first_long = None
  for i in range(len(table)):
    rec = table[i]
    prompt = np.asarray(tokenizer.encode_prompt(rec["text"]), np.int32)
    target, spans = encode_target(tokenizer, rec["target"], observation_spans, len(prompt))
    row = np.concatenate([prompt, target, np.asarray([tokenizer.eos_id], np.int32)])
    if len(row) > max_seq_len:
      where = f"{rec['file']}:{rec['row']}: {len(row)} tokens > model.max_seq_len={max_seq_len}"
      if on_bad_row == "error":
        raise DatasetError(f"{where} (data.on_bad_row=skip skips such rows)")
      skipped[OVERLONG] += 1
      first_long = first_long or where
      continue
    tokens.append(row)
    prompt_lens.append(len(prompt))
    texts.append(rec["text"])
    contexts.append(spans)
  if skipped[OVERLONG]:
    _log.warning("skipped %d SFT row(s) longer than model.max_seq_len=%d tokens, e.g. %s",
                 skipped[OVERLONG], max_seq_len, first_long)
  if not tokens:
    raise DatasetError(f"no SFT row fits model.max_seq_len={max_seq_len} tokens"
                       f" (skipped: {dict(skipped)})")
  return SftRows(tokens, prompt_lens, texts, {k: v for k, v in skipped.items() if v}, contexts)


def pack_batch(rows: Sequence[SftRow], template: dict[str, np.ndarray],
               pad_id: int) -> dict[str, np.ndarray]:
  """Rows into the learner's batch layout (``learner.train_state.batch_shapes``).

  ``inputs``/``targets`` are the row shifted by one; ``mask`` is 1 on the
  target positions that predict a target token (after the prompt, outside
  the tool observations), every
  advantage is 1 and behaviour log-probs and staleness are 0: the ``sft``
  objective's cross-entropy. ``template`` is ``Learner.batch_template`` of the
  shape to fill (rows beyond ``len(rows)`` stay all-masked padding).
  """
  out = {k: v.copy() for k, v in template.items()}
  seq = out["inputs"].shape[1] + 1
  out["inputs"][...] = pad_id
  out["targets"][...] = pad_id
  for b, (ids, n_prompt, context_spans) in enumerate(rows):
    n = len(ids)
    if n > seq:
      raise ValueError(f"row of {n} tokens in a batch of length {seq}")
    out["inputs"][b, :n - 1] = ids[:-1]
    out["targets"][b, :n - 1] = ids[1:]
    out["positions"][b] = np.arange(seq - 1)
    # Target position t predicts token t + 1: the first trained one is the
    # first target token, predicted from the prompt's last position.
    out["mask"][b, n_prompt - 1:n - 1] = 1.0
    for start, end in context_spans:
      out["mask"][b, start - 1:end - 1] = 0.0  # tokens the tool wrote are not predicted
    out["advantages"][b] = 1.0
  return out


def bucket_length(rows: Sequence[SftRow], buckets: list[int]) -> int:
  """The smallest length bucket that holds the longest row (the learner's shapes)."""
  longest = max(len(row.ids) for row in rows)
  for b in buckets:
    if b >= longest:
      return b
  return buckets[-1]


class SftStream:
  """Checkpointable stream of training batches (lists of rows).

  ``MapDataset.source(rows).shuffle(seed).repeat().batch(batch_size)``: a new
  permutation every epoch, ``num_epochs`` passes (0 = forever).
  """

  def __init__(self, rows: SftRows, batch_size: int, seed: int, num_epochs: int = 0):
    if len(rows) < batch_size:
      raise DatasetError(f"{len(rows)} SFT rows cannot fill one batch of sft.batch_size={batch_size}")
    ds = (grain.MapDataset.source(rows).shuffle(seed=seed).repeat(num_epochs or None)
          .batch(batch_size, drop_remainder=True, batch_fn=list))
    self._iter = ds.to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)).__iter__()

  def next_batch(self) -> list[SftRow]:
    return next(self._iter)

  def get_state(self) -> dict[str, Any]:
    return self._iter.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._iter.set_state(state)


