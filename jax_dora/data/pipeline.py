"""Grain prompt pipeline: checkpointable, deterministic, held-out eval split.

Two sources feed the same pipeline: the synthetic task mixture (the tiny
CI/benchmark path) and dataset files (``data.train_files``: JSONL/Parquet read
through ``jax_dora.data.files`` with a ``data.format`` mapping such as
``gsm8k``). Pipeline (all index-based, so every element is a pure function
of its position and resuming needs only an integer)::

  MapDataset.range(num_examples)            # example indices
                                            # (files: MapDataset.source(records))
    .shuffle(seed)                          # new permutation every epoch
    .repeat(num_epochs or None)             # None = forever
    .map_with_index(position, index -> Prompt)
    .to_iter_dataset(num_threads=0)         # in-memory: no reader threads

The prompt *content* is a function of ``(seed, example_index)`` only: the task
and its parameters come from ``np.random.default_rng([seed, index])``. The
``sample_id`` is the element's *stream position*, so ids are unique and
strictly increasing across epochs and restarts (the same example index seen
in two epochs yields two distinct GRPO groups).

Held-out split: a prompt belongs to eval iff ``crc32(task:text)`` falls in the
lowest ``heldout_fraction`` of the hash range. Training prompts are
rejection-sampled (with the same per-index rng, so still deterministic) to lie
outside it and eval prompts inside it, which makes the two sets disjoint *by
text*, not only by seed: short prompts such as ``"rep 1 a:"`` would otherwise
occur in both. Eval prompts use ``eval_seed`` and negative sample ids
``-1, -2, ...`` so they never collide with training groups.

Dataset files: ``sample_id`` is the stream position as above; the prompt is
row ``index`` of the validated records (``Prompt.task`` = the format name,
``Prompt.answer`` = the extracted ground truth, ``meta`` = file and line).
Eval prompts come from ``data.eval_files`` or, without them, from the rows
whose text hashes into ``heldout_fraction`` (removed from training). Prompts
whose templated token count exceeds ``rollout.max_prefill_length`` are
dropped up front, with a logged count.

Config fields: ``config.data``, typed, documented and checked in
:class:`jax_dora.config.DataConfig`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import zlib
from typing import Any, Iterator

import grain
import ml_collections
import numpy as np

from etils import epath

from jax_dora.config.data import DataConfig
from jax_dora.config.run import RunConfig
from jax_dora.csv_fields import split_csv
from jax_dora.data.files import DatasetError, RecordTable, read_records
from jax_dora.data.formats import RecordFormat, get_format
from jax_dora.tasks import TaskMixture
from jax_dora.types import Prompt

_log = logging.getLogger(__name__)

_STATE_VERSION = 1
_MAX_SPLIT_TRIES = 10_000
_HASH_RANGE = 2**32


# What every function here accepts: the typed run config or its ``data``
# block, or the ``ConfigDict`` of either (typed and checked on entry).
DataSource = DataConfig | RunConfig | ml_collections.ConfigDict


def _data_cfg(cfg: DataSource) -> DataConfig:
  """The typed ``data`` block of ``cfg`` (the full run config or the block itself)."""
  return DataConfig.of(cfg.data if hasattr(cfg, "data") else cfg)


def uses_files(cfg: DataSource) -> bool:
  """Whether prompts come from dataset files rather than the synthetic tasks."""
  return _data_cfg(cfg).uses_files


def make_mixture(cfg: DataSource) -> TaskMixture:
  """The task mixture described by ``cfg.data``."""
  d = _data_cfg(cfg)
  names = split_csv(d.tasks, str)
  weights = split_csv(d.task_weights, float) or None
  return TaskMixture(
      names,
      weights,
      max_answer_len=d.max_answer_len,
      max_prompt_len=d.max_prompt_len,
      alpha=d.length_alpha,
  )


def _text_heldout(task: str, text: str, heldout_fraction: float) -> bool:
  return zlib.crc32(f"{task}:{text}".encode()) < heldout_fraction * _HASH_RANGE


def is_heldout(prompt: Prompt, heldout_fraction: float) -> bool:
  """Whether ``prompt``'s text lies in the eval part of the hash space."""
  return _text_heldout(prompt.task, prompt.text, heldout_fraction)


def _draw(
    mixture: TaskMixture,
    seed: int,
    index: int,
    sample_id: int,
    heldout_fraction: float,
    want_heldout: bool,
) -> Prompt:
  """Deterministic prompt for ``(seed, index)`` on the requested side of the split."""
  rng = np.random.default_rng([seed, index])
  for _ in range(_MAX_SPLIT_TRIES):
    p = mixture.make_prompt(sample_id, rng)
    if is_heldout(p, heldout_fraction) == want_heldout:
      return p
  raise RuntimeError(
      f"no {'eval' if want_heldout else 'train'} prompt after {_MAX_SPLIT_TRIES}"
      f" draws (seed={seed}, index={index}); heldout_fraction={heldout_fraction}"
      " is too extreme for this task mixture"
  )


@dataclasses.dataclass
class FileSplits:
  """Validated train and eval records of a file dataset."""

  fmt: RecordFormat
  train: RecordTable
  eval: RecordTable
  # Rows left out, by reason: bad rows of every file read, overlong prompts.
  skipped: dict[str, int]
  overlong: int


def _split_heldout(table: RecordTable, fmt: RecordFormat, frac: float) -> tuple[list[int], list[int]]:
  train, heldout = [], []
  for i, text in enumerate(table.texts):
    (heldout if _text_heldout(fmt.name, text, frac) else train).append(i)
  return train, heldout


def _fits(table: RecordTable, tokenizer: Any, max_tokens: int | None) -> list[int]:
  if tokenizer is None or max_tokens is None:
    return list(range(len(table)))
  return [i for i, t in enumerate(table.texts) if len(tokenizer.encode_prompt(t)) <= max_tokens]


@functools.lru_cache(maxsize=4)
def _load_file_splits(key: str, tokenizer: Any, max_tokens: int | None) -> FileSplits:
  d = json.loads(key)
  fmt = get_format(d["format"], d["prompt_field"], d["answer_field"])
  train = read_records(split_csv(d["train_files"], str), fmt, d["on_bad_row"], d["eval_group_field"])
  skipped = collections.Counter(train.skipped)
  if d["eval_files"]:
    evals = read_records(split_csv(d["eval_files"], str), fmt, d["on_bad_row"], d["eval_group_field"])
    skipped.update(evals.skipped)
  else:
    keep, held = _split_heldout(train, fmt, d["heldout_fraction"])
    if not keep or not held:
      raise DatasetError(
          f"data.heldout_fraction={d['heldout_fraction']} leaves {len(keep)} train and"
          f" {len(held)} eval rows of {len(train)}: set data.eval_files or change the fraction")
    train, evals = train.select(keep), train.select(held)
  n_before = len(train) + len(evals)
  train = train.select(_fits(train, tokenizer, max_tokens))
  evals = evals.select(_fits(evals, tokenizer, max_tokens))
  overlong = n_before - len(train) - len(evals)
  if overlong:
    _log.warning("dropped %d prompt(s) longer than %d tokens (rollout.max_prefill_length)",
                 overlong, max_tokens)
    skipped["prompt longer than rollout.max_prefill_length"] = overlong
  if not len(train) or not len(evals):
    raise DatasetError(
        f"no {'training' if not len(train) else 'eval'} prompt fits rollout.max_prefill_length="
        f"{max_tokens} tokens")
  return FileSplits(fmt, train, evals, dict(skipped), overlong)


def _files_key(d: DataConfig) -> str:
  keys = ("train_files", "eval_files", "format", "prompt_field", "answer_field", "on_bad_row",
          "heldout_fraction", "eval_group_field")
  return json.dumps({k: getattr(d, k) for k in keys}, sort_keys=True)


def load_file_splits(cfg: DataSource, tokenizer: Any = None) -> FileSplits:
  """Train/eval records of ``cfg.data``'s files (cached per config and tokenizer).

  With a ``tokenizer`` (and the full run config), prompts longer than
  ``rollout.max_prefill_length`` tokens after templating are dropped.
  """
  max_tokens = cfg.rollout.max_prefill_length if hasattr(cfg, "rollout") else None
  return _load_file_splits(_files_key(_data_cfg(cfg)), tokenizer, max_tokens)


def _record_prompt(fmt: RecordFormat, sample_id: int, rec: dict[str, Any]) -> Prompt:
  meta = {"file": rec["file"], "row": rec["row"]}
  if rec["group"]:
    meta["group"] = rec["group"]
  return Prompt(sample_id=int(sample_id), task=fmt.name, text=rec["text"], answer=rec["answer"],
                meta=meta)


def make_prompt_dataset(cfg: DataSource, tokenizer: Any = None) -> grain.MapDataset:
  """Training prompts as a ``MapDataset`` whose element ``i`` has ``sample_id == i``."""
  d = _data_cfg(cfg)
  if d.uses_files:
    splits = load_file_splits(cfg, tokenizer)
    seed = d.seed
    return (
        grain.MapDataset.source(splits.train)
        .shuffle(seed=seed)
        .repeat(d.num_epochs or None)
        .map_with_index(lambda position, rec: _record_prompt(splits.fmt, position, rec))
    )
  mixture = make_mixture(d)
  seed, frac = d.seed, d.heldout_fraction

  def to_prompt(position: int, index: int) -> Prompt:
    return _draw(mixture, seed, int(index), int(position), frac, want_heldout=False)

  return (
      grain.MapDataset.range(d.num_examples)
      .shuffle(seed=seed)
      .repeat(d.num_epochs or None)
      .map_with_index(to_prompt)
  )


def make_eval_prompts(cfg: DataSource, n: int, tokenizer: Any = None) -> list[Prompt]:
  """``n`` held-out prompts (``eval_seed``, ids ``-1..-n``), disjoint by text from training.

  File datasets hold a finite eval set: at most all of it is returned.
  """
  d = _data_cfg(cfg)
  if d.uses_files:
    splits = load_file_splits(cfg, tokenizer)
    order = np.random.default_rng(d.eval_seed).permutation(len(splits.eval))
    return [_record_prompt(splits.fmt, -(i + 1), splits.eval[int(j)])
            for i, j in enumerate(order[:n])]
  mixture = make_mixture(d)
  return [
      _draw(mixture, d.eval_seed, i, -(i + 1), d.heldout_fraction, want_heldout=True)
      for i in range(n)
  ]


def config_fingerprint(cfg: DataSource) -> str:
  """Short hash of the fields that determine the stream's contents."""
  d = _data_cfg(cfg)
  if d.uses_files:
    keys = ("train_files", "eval_files", "format", "prompt_field", "answer_field", "on_bad_row",
            "seed", "heldout_fraction", "num_epochs", "prompt_template", "system_prompt",
            "prompt_suffix")
    sizes = [epath.Path(p).stat().length for p in split_csv(d.train_files, str)]
    blob = json.dumps({**{k: str(getattr(d, k)) for k in keys}, "sizes": sizes}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
  keys = ("tasks", "task_weights", "seed", "heldout_fraction", "max_answer_len",
          "max_prompt_len", "length_alpha", "num_examples", "num_epochs")
  blob = json.dumps({k: str(getattr(d, k)) for k in keys}, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


class PromptStream:
  """Checkpointable iterator of training prompts.

  The orchestrator pulls with :meth:`next_prompt`; the run checkpoint stores
  :meth:`get_state` (a small JSON-serialisable dict) and a resumed run calls
  :meth:`set_state` on a fresh stream, which then yields exactly the prompts
  the old one would have yielded next, with the same sample ids.
  """

  def __init__(self, cfg: DataSource, tokenizer: Any = None):
    self._fingerprint = config_fingerprint(cfg)
    ds = make_prompt_dataset(cfg, tokenizer)
    # Prompts are generated in memory in microseconds: reader threads would
    # only add GIL contention and make the state harder to reason about.
    self._iter = ds.to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    ).__iter__()
    self._next_sample_id = 0

  @property
  def next_sample_id(self) -> int:
    """The sample id the next call to :meth:`next_prompt` will return."""
    return self._next_sample_id

  def next_prompt(self) -> Prompt:
    """Returns the next training prompt.

    Raises:
      StopIteration: after ``num_epochs`` epochs (never when it is 0).
    """
    p = next(self._iter)
    if p.sample_id != self._next_sample_id:
      raise RuntimeError(
          f"stream out of sync: got sample_id {p.sample_id}, expected {self._next_sample_id}"
      )
    self._next_sample_id += 1
    return p

  def __iter__(self) -> Iterator[Prompt]:
    return self

  def __next__(self) -> Prompt:
    return self.next_prompt()

  def get_state(self) -> dict[str, Any]:
    return {
        "version": _STATE_VERSION,
        "next_sample_id": self._next_sample_id,
        "fingerprint": self._fingerprint,
        "grain": self._iter.get_state(),
    }

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from ``state``; rejects states from a different data config.

    Raises:
      ValueError: unknown state version, or the data config that produced the
        state differs from this stream's (resuming would repeat or skip
        samples).
    """
    if state.get("version") != _STATE_VERSION:
      raise ValueError(f"unsupported PromptStream state version {state.get('version')!r}")
    if state.get("fingerprint") != self._fingerprint:
      raise ValueError(
          "PromptStream state was saved with a different data config"
          f" (fingerprint {state.get('fingerprint')} != {self._fingerprint});"
          " restore with the original cfg.data"
      )
    self._iter.set_state(state["grain"])
    self._next_sample_id = int(state["next_sample_id"])
