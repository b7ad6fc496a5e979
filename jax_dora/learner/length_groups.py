"""Length-grouped micro-batches: each micro-batch padded to its own bucket.

A training batch is padded to the bucket of its *longest* row
(``learner.batching``), so with long-tailed reasoning lengths one 2k-token
answer makes every row of the batch pay for 2k positions, and the learner's
attention is quadratic in that length. Sorting the rows by the length they
really need and cutting micro-batches from the sorted order (Hugging Face's
``group_by_length``, verl's dynamic micro-batches) lets each micro-batch run at
the smallest bucket that holds *its* rows: the long row still pays for its
length, the short ones do not.

The update is unchanged: a row's loss only depends on positions up to its
last trained target (causal attention), normalisers come from whole-batch
:class:`~jax_dora.learner.losses.BatchTotals`, and micro-batch gradients add
up. Only the floating-point summation order differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class MicroBatch:
  """Rows of the batch (ascending indices) run together, and their padded length."""

  rows: np.ndarray
  positions: int  # input/target positions per row (a bucket's seq_len - 1)


def needed_positions(mask: np.ndarray) -> np.ndarray:
  """``[rows]``: one past each row's last trained target position (0 if none).

  Positions after it cannot change the row's loss (attention is causal), so
  they need not be computed.
  """
  trained = np.asarray(mask) > 0
  last_from_end = np.argmax(trained[:, ::-1], axis=1)
  return np.where(trained.any(axis=1), trained.shape[1] - last_from_end, 0)


def plan_micro_batches(mask: np.ndarray, micro_rows: int,
                       seq_len_buckets: Sequence[int]) -> list[MicroBatch]:
  """Cuts ``micro_rows``-row micro-batches from the rows sorted by needed length.

  Each micro-batch gets the smallest bucket (``seq_len - 1`` positions) that
  holds its longest row, never more than the batch's own positions. The
  number of rows must be a multiple of ``micro_rows`` (the config checks it),
  so every micro-batch has the same row count and the set of compiled
  shapes is one per bucket.
  """
  rows, batch_positions = np.shape(mask)
  if micro_rows <= 0 or rows % micro_rows:
    raise ValueError(f"{rows} rows are not a multiple of micro_batch_size={micro_rows}")
  need = needed_positions(mask)
  order = np.argsort(need, kind="stable")
  out = []
  for start in range(0, rows, micro_rows):
    members = order[start:start + micro_rows]
    longest = int(need[members].max())
    positions = next((int(b) - 1 for b in sorted(seq_len_buckets) if int(b) - 1 >= longest),
                     batch_positions)
    out.append(MicroBatch(np.sort(members), min(positions, batch_positions)))
  return out


def take_micro_batch(batch: dict[str, np.ndarray], micro: MicroBatch) -> dict[str, np.ndarray]:
  """The micro-batch's rows, cut to its positions (``[rows]`` arrays only row-indexed)."""
  out = {}
  for key, value in batch.items():
    value = np.asarray(value)[micro.rows]
    out[key] = value[:, :micro.positions] if value.ndim >= 2 else value
  return out
