"""Prompt/answer records from JSONL and Parquet files, as a Grain data source.

``read_records`` reads every file once, validates each row against a
:class:`~jax_dora.data.formats.RecordFormat` and keeps only the two fields
the run needs (prompt text and ground truth) plus where each came from. The
resulting :class:`RecordTable` implements Grain's random-access data-source
protocol (``__len__`` / ``__getitem__``), so the training pipeline is a plain
``grain.MapDataset.source(table)`` with an index-based, checkpointable
position.

Bad rows (invalid JSON, a missing or empty mapped field, an answer the
format cannot read) are either skipped with a logged count and the first
few ``file:line: reason`` examples (``data.on_bad_row=skip``, the default),
or stop the run with that message (``error``). A file where *no* row is
usable is always an error, as is a Parquet file without the mapped column.
Paths go through ``etils.epath``, so ``gs://`` files work like local ones.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from etils import epath

from jax_dora.data.formats import RecordFormat

_log = logging.getLogger(__name__)

BAD_ROW_POLICIES = ("skip", "error")
_EXAMPLES = 3


class DatasetError(ValueError):
  """A dataset file is missing, unreadable or has no usable rows."""


@dataclasses.dataclass
class RecordTable:
  """Validated records: ``table[i] -> {"text", "answer", "target", "file", "row"}``.

  ``answer`` is the ground truth the format extracts (GSM8K: what follows
  ``####``); ``target`` is the answer field verbatim (GSM8K: the worked
  solution), what supervised fine-tuning trains on.
  """

  texts: list[str]
  answers: list[str]
  origins: list[tuple[int, int]]  # (index into files, 1-based row/line)
  files: list[str]
  skipped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
  targets: list[str] = dataclasses.field(default_factory=list)
  # ``group_field``'s value of each row ("" without one): what eval metrics split by.
  groups: list[str] = dataclasses.field(default_factory=list)

  def __len__(self) -> int:
    return len(self.texts)

  def __getitem__(self, i: int) -> dict[str, Any]:
    f, row = self.origins[i]
    return {"text": self.texts[i], "answer": self.answers[i], "target": self.targets[i],
            "group": self.groups[i], "file": self.files[f], "row": row}

  def select(self, indices: Sequence[int]) -> "RecordTable":
    return RecordTable([self.texts[i] for i in indices], [self.answers[i] for i in indices],
                       [self.origins[i] for i in indices], self.files, collections.Counter(self.skipped),
                       [self.targets[i] for i in indices], [self.groups[i] for i in indices])


def _rows(path: epath.Path, fmt: RecordFormat) -> Iterator[tuple[int, Any]]:
  """``(line_or_row_number, row)``; ``row`` is an error string for unparsable JSON."""
  name = path.name.lower()
  if name.endswith(".parquet"):
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    with path.open("rb") as f:
      pf = pq.ParquetFile(f)
      columns = set(pf.schema_arrow.names)
      missing = [c for c in (fmt.prompt_field, fmt.answer_field) if c not in columns]
      if missing:
        raise DatasetError(
            f"{path}: no column {missing} for data.format={fmt.name!r}; columns: {sorted(columns)}"
            " (set data.prompt_field / data.answer_field)")
      n = 0
      for batch in pf.iter_batches(columns=[fmt.prompt_field, fmt.answer_field]):
        for row in batch.to_pylist():
          n += 1
          yield n, row
    return
  if not name.endswith((".jsonl", ".json")):
    raise DatasetError(f"{path}: unsupported file type (use .jsonl or .parquet)")
  with path.open("r") as f:
    for n, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        yield n, json.loads(line)
      except json.JSONDecodeError as e:
        yield n, f"not valid JSON ({e.msg})"


def _field(row: Any, name: str) -> str | None:
  value = row.get(name) if isinstance(row, dict) else None
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    value = str(value)
  return value if isinstance(value, str) and value.strip() else None


def read_records(
    paths: Sequence[str], fmt: RecordFormat, on_bad_row: str = "skip", group_field: str = ""
) -> RecordTable:
  """Reads and validates every row of ``paths`` (see module doc for bad rows).

  ``group_field``: a row field kept as ``table[i]["group"]`` (``"field=value"``;
  ``""`` where the row lacks it), e.g. a difficulty level the eval splits by.

  Raises:
    DatasetError: a missing file, an unsupported type, a Parquet file without
      the mapped columns, a bad row under ``on_bad_row="error"``, or a file
      with no usable row.
  """
  if on_bad_row not in BAD_ROW_POLICIES:
    raise ValueError(f"data.on_bad_row={on_bad_row!r} is not one of {BAD_ROW_POLICIES}")
  if not paths:
    raise DatasetError("no dataset files given")
  table = RecordTable([], [], [], [])
  for fi, p in enumerate(paths):
    path = epath.Path(p)
    if not path.exists():
      raise DatasetError(f"dataset file {path} does not exist")
    table.files.append(str(path))
    bad: collections.Counter[str] = collections.Counter()
    examples: list[str] = []
    kept = 0
    for n, row in _rows(path, fmt):
      text = _field(row, fmt.prompt_field)
      answer_field = _field(row, fmt.answer_field)
      if isinstance(row, str):
        why = row
      elif text is None:
        why = f"no prompt field {fmt.prompt_field!r}"
      elif answer_field is None:
        why = f"no answer field {fmt.answer_field!r}"
      else:
        answer = fmt.extract_answer(answer_field)
        why = "" if answer else f"answer field {fmt.answer_field!r} has no {fmt.name} answer"
      if why:
        if on_bad_row == "error":
          raise DatasetError(f"{path}:{n}: {why} (data.on_bad_row=skip skips such rows)")
        bad[why] += 1
        if len(examples) < _EXAMPLES:
          examples.append(f"{path}:{n}: {why}")
        continue
      table.texts.append(text)
      table.answers.append(answer)
      table.targets.append(answer_field)
      value = row.get(group_field) if group_field else None
      table.groups.append(f"{group_field}={value}" if value is not None else "")
      table.origins.append((fi, n))
      kept += 1
    if not kept:
      raise DatasetError(
          f"{path}: no usable row for data.format={fmt.name!r}"
          f" (fields {fmt.prompt_field!r}/{fmt.answer_field!r}); e.g. {examples}")
    table.skipped.update(bad)
    if bad:
      _log.warning("%s: skipped %d bad row(s) of %d (%s); e.g. %s", path, sum(bad.values()),
                   kept + sum(bad.values()), dict(bad), "; ".join(examples))
  return table
