"""JSONL files (metrics, the trained-sample log) on a local disk or an object store.

JSONL rather than a binary summary format so that a run's metrics can be
tailed, grepped, and plotted by a plain script (``scripts/plot_metrics.py``)
without the training stack installed, and so that a killed run loses at most
its last line.

Every path goes through ``etils.epath`` (the path abstraction Orbax uses), so an
``output_dir`` of ``gs://bucket/run`` writes objects to the bucket instead of a
local directory named ``gs:``. Object stores have neither append nor an atomic
rename (gcsfs silently turns ``mode="a"`` into an overwrite; a "rename" is a
copy plus a delete), so :class:`JsonlAppender` writes the two kinds differently:

* a local path is appended to, one flushed line per record, readable while it
  is written, and rewritten atomically (temporary file + ``os.replace``);
* a URI (``scheme://...``) keeps the whole file's lines in memory and rewrites
  the object with all of them on every flush. An object upload is atomic
  (readers see the old or the new object), so the file is never torn. Flushes
  are throttled (``flush_interval_s``) because each one re-uploads the file,
  and they happen only between batches of records (never inside one learner
  step's records), plus on :meth:`JsonlAppender.flush` and ``close()``. A
  killed process loses at most the records of the last interval.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from etils import epath
import numpy as np

log = logging.getLogger(__name__)

PathLike = str | os.PathLike | epath.Path

# Seconds between two uploads of a remote (object-store) JSONL file. Each upload
# rewrites the whole object, so this bounds both the cost and what a killed
# process can lose.
REMOTE_FLUSH_INTERVAL_S = 30.0


def to_jsonable(x: Any) -> Any:
  """Converts numpy / JAX scalars and arrays, tuples and non-finite floats.

  Non-finite floats become the strings ``"NaN"``, ``"Infinity"`` and
  ``"-Infinity"`` (what ``float()`` parses back): bare ``NaN`` is not JSON,
  and ``null`` would hide a diverged value as a merely missing one.
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
    if math.isfinite(x):
      return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
  if x is None or isinstance(x, str):
    return x
  if hasattr(x, "__array__"):  # np.ndarray, jax.Array
    arr = np.asarray(x)
    return to_jsonable(arr.item() if arr.ndim == 0 else arr.tolist())
  return str(x)


def is_remote(path: PathLike) -> bool:
  """True for a URI (``gs://``, ``s3://``, ...): an object store without append."""
  return "://" in os.fspath(path)


def as_path(path: PathLike) -> epath.Path:
  return epath.Path(path)


class JsonlAppender:
  """Appends lines to a JSONL file, local or remote (see the module docstring).

  Thread-safe. ``append`` takes a batch of already serialised lines: a remote
  file is uploaded only between batches, so a batch (e.g. one learner step's
  trained records) is never split by a crash.
  """

  def __init__(self, path: PathLike, *, keep: Sequence[dict[str, Any]] | None = None,
               flush_interval_s: float = REMOTE_FLUSH_INTERVAL_S):
    """Opens ``path``.

    Args:
      path: the JSONL file (local path or URI).
      keep: replace an existing file's records with these first (a resumed or
        fresh run). ``None`` continues the file as it is.
      flush_interval_s: remote files only: least seconds between two uploads
        made by ``append`` (``flush()`` and ``close()`` always upload).
    """
    self.path = as_path(path)
    self.remote = is_remote(path)
    self.flush_interval_s = float(flush_interval_s)
    self._lock = threading.RLock()
    self._file = None
    self._closed = False
    if self.remote:
      # No parent "directories" to create on an object store.
      if keep is None:
        exists = self.path.exists()
        keep = read_jsonl(self.path) if exists else []
        dirty = not exists
      else:
        dirty = True
      self._lines = [json.dumps(r) + "\n" for r in keep]
      self._dirty = dirty
      self._last_upload = -math.inf
      self.flush()
    else:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      if keep is not None:
        rewrite_jsonl(self.path, keep)
      self._file = self.path.open("a", encoding="utf-8")

  def append(self, lines: Iterable[str]) -> None:
    """Writes lines (each a JSON object without its newline) as one batch."""
    with self._lock:
      if self._closed:
        raise ValueError(f"{self.path} is closed")
      lines = [ln + "\n" for ln in lines]
      if self._file is not None:
        for ln in lines:  # one flushed line at a time: readable while written
          self._file.write(ln)
          self._file.flush()
        return
      self._lines.extend(lines)
      self._dirty = self._dirty or bool(lines)
      if time.monotonic() - self._last_upload >= self.flush_interval_s:
        try:
          self.flush()
        except Exception:  # pylint: disable=broad-except
          # A transient store error must not kill training: the lines stay
          # buffered and the next interval (or flush/close, which raise) retries.
          log.warning("%s: upload failed, retrying in %.0f s", self.path,
                      self.flush_interval_s, exc_info=True)
          self._last_upload = time.monotonic()

  def flush(self) -> None:
    """Makes everything appended so far durable (a remote file is uploaded)."""
    with self._lock:
      if self._file is not None:
        self._file.flush()
      elif not self._closed and self._dirty:
        self.path.write_text("".join(self._lines))  # one atomic object upload
        self._dirty = False
        self._last_upload = time.monotonic()

  def close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self.flush()
      self._closed = True
      if self._file is not None:
        self._file.close()
        self._file = None


class MetricsWriter:
  """Appends metric records (dicts) to ``path``, one JSON object per line."""

  def __init__(self, path: PathLike, keep_through_step: int | None = None, *,
               flush_interval_s: float = REMOTE_FLUSH_INTERVAL_S):
    """Opens ``path`` (a local path or a ``gs://``-style URI) for appending.

    Args:
      path: the JSONL file.
      keep_through_step: for an existing file, keep only records with ``step <=
        N`` first. A run resumed from its step-N checkpoint repeats the steps
        a killed run had logged after N, and a fresh run (``N=0``) must not
        inherit an earlier run's curves: either would put two records of one
        step in the file and corrupt every plot and benchmark read from it.
        ``None`` appends to the file as is.
      flush_interval_s: for a URI, least seconds between two uploads (each
        rewrites the whole object); ``close()`` and ``flush()`` always upload.
    """
    self.path = os.fspath(path)
    keep = None
    if keep_through_step is not None:
      p = as_path(path)
      keep = ([r for r in read_jsonl(p) if int(r.get("step", 0)) <= keep_through_step]
              if p.exists() else [])
    self._out = JsonlAppender(path, keep=keep, flush_interval_s=flush_interval_s)
    self._count = 0

  def write(self, record: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    """Writes ``record`` plus ``step`` and ``time`` (unix seconds); returns the line's dict.

    ``step`` defaults to ``record["step"]``, else the number of records written.
    """
    if self._out is None:
      raise ValueError(f"MetricsWriter({self.path}) is closed")
    rec = to_jsonable(dict(record))
    if step is not None:
      rec["step"] = int(step)
    rec.setdefault("step", self._count)
    rec.setdefault("time", time.time())
    self._out.append([json.dumps(rec, allow_nan=False)])
    self._count += 1
    return rec

  def flush(self) -> None:
    """Makes every record written so far durable (uploads a remote file)."""
    if self._out is not None:
      self._out.flush()

  def close(self) -> None:
    if self._out is not None:
      self._out.close()
      self._out = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_metrics(path: PathLike) -> list[dict[str, Any]]:
  """Reads every metrics record; a torn last line is skipped."""
  return read_jsonl(path)


def rewrite_jsonl(path: PathLike, records: Sequence[dict[str, Any]]) -> None:
  """Replaces ``path`` with ``records`` atomically (a kill leaves the old or the new file).

  Locally through a temporary file and ``os.replace``; a remote object is
  uploaded in one piece, which object stores make atomic (their "rename" is a
  copy plus a delete, so it is not used there).
  """
  p = as_path(path)
  text = "".join(json.dumps(r) + "\n" for r in records)
  if is_remote(path):
    p.write_text(text)
    return
  tmp = p.with_name(p.name + ".tmp")
  tmp.write_text(text)
  tmp.replace(p)


def read_jsonl(path: PathLike) -> list[dict[str, Any]]:
  """Reads every record; a torn last line (run killed mid-write) is skipped."""
  lines = as_path(path).read_text().splitlines()
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
