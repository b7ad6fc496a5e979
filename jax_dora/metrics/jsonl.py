"""Append-only JSONL metrics: one JSON object per line, readable while written.

JSONL rather than a binary summary format so that a run's metrics can be
tailed, grepped, and plotted by a plain script (``scripts/plot_metrics.py``)
without the training stack installed, and so that a killed run loses at most
its last line. Every line is flushed as it is written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def to_jsonable(x: Any) -> Any:
  """Converts numpy / JAX scalars and arrays, tuples and non-finite floats.

  Non-finite floats become ``None``: ``NaN`` is not JSON, and a file other
  tools cannot parse is worse than a missing point on a plot.
  """
  if isinstance(x, dict):
    return {str(k): to_jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [to_jsonable(v) for v in x]
  if isinstance(x, (bool, np.bool_)):
    return bool(x)
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    x = float(x)
    return x if math.isfinite(x) else None
  if x is None or isinstance(x, str):
    return x
  if hasattr(x, "__array__"):  # np.ndarray, jax.Array
    arr = np.asarray(x)
    return to_jsonable(arr.item() if arr.ndim == 0 else arr.tolist())
  return str(x)


class MetricsWriter:
  """Appends metric records (dicts) to ``path``, one JSON object per line."""

  def __init__(self, path: str | os.PathLike, keep_through_step: int | None = None):
    """Opens ``path`` for appending.

    Args:
      path: the JSONL file.
      keep_through_step: for an existing file, keep only records with ``step <=
        N`` first. A run resumed from its step-N checkpoint repeats the steps
        a killed run had logged after N, and a fresh run (``N=0``) must not
        inherit an earlier run's curves: either would put two records of one
        step in the file and corrupt every plot and benchmark read from it.
        ``None`` appends to the file as is.
    """
    self.path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    if keep_through_step is not None and os.path.exists(self.path):
      rewrite_jsonl(
          self.path, [r for r in read_jsonl(self.path) if int(r.get("step", 0)) <= keep_through_step])
    self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
    self._count = 0

  def write(self, record: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    """Writes ``record`` plus ``step`` and ``time`` (unix seconds); returns the line's dict.

    ``step`` defaults to ``record["step"]``, else the number of records written.
    """
    if self._file is None:
      raise ValueError(f"MetricsWriter({self.path}) is closed")
    rec = to_jsonable(dict(record))
    if step is not None:
      rec["step"] = int(step)
    rec.setdefault("step", self._count)
    rec.setdefault("time", time.time())
    self._file.write(json.dumps(rec, allow_nan=False) + "\n")
    self._file.flush()
    self._count += 1
    return rec

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Reads every metrics record; a torn last line is skipped."""
  return read_jsonl(path)


def rewrite_jsonl(path: str | os.PathLike, records: list[dict[str, Any]]) -> None:
  """Replaces ``path`` with ``records`` atomically (a kill leaves the old or the new file)."""
  tmp = os.fspath(path) + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  os.replace(tmp, path)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Reads every record; a torn last line (run killed mid-write) is skipped."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  out = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      if i == len(lines) - 1:
        log.warning("%s: skipping torn last line", path)
        continue
      raise ValueError(f"{path}:{i + 1}: not valid JSON: {line[:80]!r}") from None
  return out
