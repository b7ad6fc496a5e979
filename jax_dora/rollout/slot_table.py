"""The host's view of a server's decode slots: who occupies each, where it writes, what it sampled.

The engine's decode programs are static (``jax_dora.rollout.buckets``): the
host must tell each step the highest position any slot writes at and how many
slots each live version holds. This table is the one place that knows, and the
only builder of a step's :class:`MultiVersionParams` and :class:`DecodeHint`.
**The position rule**: a slot admitted with a ``context_len``-token context
writes its next decode token at ``context_len``, and one position further per
dispatched step, capped at the cache end (where the device stops advancing it).

Sampled tokens land in per-slot numpy buffers with vectorised updates, so no
Python loop runs per slot per token. Each occupancy gets a fresh owner id: a
dispatched step's results count only for slots still held by the occupant the
step was dispatched for (the driver reads step ``t`` while ``t + 1`` runs).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_dora.rollout import api
from jax_dora.rollout.engine_types import DecodeHint, MultiVersionParams, Params
from jax_dora.rollout.api import ResumeParts


@dataclasses.dataclass
class Active:
  """A request occupying a decode slot (its tokens live in the table's buffers)."""

  request: api.RolloutRequest
  callback: Callable[[Any], None]
  version: int
  slot: int
  context_len: int  # prompt + resume prefix (tokens in the cache before new ones)
  budget: int  # new tokens this span may still produce (max_new_tokens and cache)
  resume: ResumeParts
  stream: bool = True  # send RolloutChunks (False: only the terminal item)
  sent: int = 0  # tokens already streamed in chunks
  # Multi-turn: token ids that may complete one of the request's stop strings.
  stop_triggers: frozenset[int] = frozenset()
  # MoE: routes of every position the slot runs, ``[context_len + budget,
  # moe_layers, k]`` (``jax_dora.model.routing``); None for a dense model.
  routes: np.ndarray | None = None


class SlotTable:
  """Occupants, positions and sampled-token buffers of ``num_slots`` decode slots."""

  def __init__(self, num_slots: int, max_seq_len: int):
    self.num_slots, self.max_seq_len = int(num_slots), int(max_seq_len)
    n, width = self.num_slots, self.max_seq_len
    self.occupants: list[Active | None] = [None] * n
    self.tokens = np.zeros((n, width), np.int32)
    self.logprobs = np.zeros((n, width), np.float32)
    self.count = np.zeros((n,), np.int64)
    self.budget = np.zeros((n,), np.int64)
    self.ignore_eos = np.zeros((n,), bool)
    self.owner = np.full((n,), -1, np.int64)
    self.position = np.zeros((n,), np.int64)
    self._next_owner = 0
    self.to_free: set[int] = set()  # vacated slots still active on the device

  # ------------------------------------------------------------- occupancy
  def free_slots(self) -> list[int]:
    return [i for i, s in enumerate(self.occupants) if s is None]

  def active(self) -> list[Active]:
    return [s for s in self.occupants if s is not None]

  def any_occupied(self) -> bool:
    return bool((self.owner >= 0).any())

  def occupy(self, act: Active) -> int:
    """Puts ``act`` in its slot; returns the occupancy's owner id."""
    self._next_owner += 1
    slot = act.slot
    self.occupants[slot] = act
    self.owner[slot] = self._next_owner
    self.count[slot] = 0
    self.position[slot] = act.context_len
    self.budget[slot] = act.budget
    self.ignore_eos[slot] = bool(act.request.ignore_eos)
    return self._next_owner

  def vacate(self, slot: int) -> None:
    self.occupants[slot] = None
    self.owner[slot] = -1
    self.to_free.add(slot)

  # ------------------------------------------------------------------ steps
  def step_inputs(self, params_of: Callable[[int], Params]) -> tuple[MultiVersionParams, DecodeHint]:
    """The next step's live versions (with their params) and its hint."""
    occupied = self.owner >= 0
    rows = collections.Counter(s.version for s in self.active())
    live = tuple(sorted(rows))
    return (MultiVersionParams({v: params_of(v) for v in live}, live),
            DecodeHint(int(self.position[occupied].max()), dict(rows)))

  def advance(self) -> None:
    """After a dispatch: every occupied slot writes one position further (capped)."""
    occupied = self.owner >= 0
    self.position[occupied] = np.minimum(self.position[occupied] + 1, self.max_seq_len)

  def still_owned(self, owners: np.ndarray) -> np.ndarray:
    """Rows whose occupant is the one ``owners`` (a step's dispatch-time snapshot) names."""
    return np.flatnonzero((owners >= 0) & (owners == self.owner))

  # ---------------------------------------------------------------- tokens
  def append(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
    n = self.count[rows]
    self.tokens[rows, n] = tokens
    self.logprobs[rows, n] = logprobs
    self.count[rows] = n + 1

  def sampled(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """Copies of the tokens and log-probs ``slot``'s occupant has sampled."""
    n = int(self.count[slot])
    return self.tokens[slot, :n].copy(), self.logprobs[slot, :n].copy()

  def unsent(self, act: Active) -> api.RolloutChunk | None:
    """The chunk of tokens sampled since the last one (marked sent), or None."""
    n = int(self.count[act.slot])
    if not act.stream or act.sent >= n:
      return None
    chunk = api.RolloutChunk(act.request.request_id, self.tokens[act.slot, act.sent:n].copy(),
                             self.logprobs[act.slot, act.sent:n].copy(), act.version)
    act.sent = n
    return chunk
