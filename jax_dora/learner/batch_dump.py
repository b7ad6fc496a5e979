"""Writes every trained batch to disk (``learner.dump_batches_dir``).

What the learner saw, exactly, step by step: for replaying a run's updates
offline (e.g. on a different mesh, or after a loss spike) and for checking
that a multi-process learner computes what a single process computes on the
same data (``tests/test_multiprocess.py``).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from etils import epath


class BatchRecorder:
  """Wraps a learner: saves each host batch as ``step_<n>.npz`` before training on it."""

  def __init__(self, learner: Any, directory: str):
    self._learner = learner
    self._dir = epath.Path(directory)
    self._dir.mkdir(parents=True, exist_ok=True)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._learner, name)

  def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    buf = io.BytesIO()
    np.savez(buf, **batch)
    (self._dir / f"step_{self._learner.step + 1:06d}.npz").write_bytes(buf.getvalue())
    return self._learner.train_step(batch)


def load_batches(directory: str) -> list[dict[str, np.ndarray]]:
  """The recorded batches in step order."""
  out = []
  for f in sorted(epath.Path(directory).glob("step_*.npz")):
    with np.load(io.BytesIO(f.read_bytes())) as z:
      out.append({k: z[k] for k in z.files})
  return out
