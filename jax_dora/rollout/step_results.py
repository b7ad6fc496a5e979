"""Reading a dispatched decode step back: first tokens of new requests, every slot's new token.

The driver dispatches step ``t + 1`` before it reads step ``t``
(:class:`DispatchedStep`), so results are matched to slots by the owner id
each slot had at dispatch: a row counts only while its slot still holds that
occupant. For an MoE policy the routes each token was computed under are
written into the slot's record here (routing replay).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_dora.model import routing
from jax_dora.rollout.engine_types import FirstToken
from jax_dora.rollout.slot_table import SlotTable


@dataclasses.dataclass
class DispatchedStep:
  """A decode step whose tokens are not read yet.

  ``owners``: the slot occupants' ids at dispatch (-1 = empty). ``firsts``:
  first tokens of the requests admitted just before this step, recorded first.
  """

  result: object
  owners: np.ndarray
  firsts: list[tuple[int, int, FirstToken]]  # (slot, owner id, where its first token is)
  dispatched_at: float


def first_tokens(step: DispatchedStep, slots: SlotTable
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(rows, tokens, logprobs)`` of the step's newly admitted requests still in their
  slots (one read-back for all); their context routes go into the slots' records."""
  arrays = {id(a): a for _, _, f in step.firsts for a in (f.values, f.routes) if a is not None}
  host = dict(zip(arrays, jax.device_get(list(arrays.values()))))
  rows = np.asarray([f[0] for f in step.firsts])
  keep = slots.owner[rows] == np.asarray([f[1] for f in step.firsts])
  values = np.stack([host[id(f.values)][f.row] for _, _, f in step.firsts])
  for (slot, _, f), kept in zip(step.firsts, keep):
    s = slots.occupants[slot]
    if kept and f.routes is not None:
      # The context's routes: recorded ones (a resume, a tool turn) stay.
      got = host[id(f.routes)][f.context]
      if f.offset:  # a held-context resume ran only the positions from its offset on
        fresh = np.full((s.context_len,) + got.shape[1:], routing.no_route(got.dtype), got.dtype)
        fresh[f.offset:] = got[:s.context_len - f.offset]
      else:
        fresh = got[:s.context_len]
      s.routes[:s.context_len] = routing.keep_recorded(s.request.resume_routing, fresh)
  return rows[keep], values[keep, 0].astype(np.int32), values[keep, 1]


def step_tokens(step: DispatchedStep, slots: SlotTable, name: str, index: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(rows, tokens, logprobs)`` of the slots whose occupant the step ran for (waits for
  the device). Raises RuntimeError if the step ran with a wrong hint."""
  data = np.asarray(step.result.data)
  logprobs = np.asarray(step.result.logprobs)[:, 0]
  if bool(np.asarray(step.result.hint_violated)):
    # The static program read fewer cache entries (or rows) than a slot
    # needed: its tokens are wrong. Crash loudly (every open request fails
    # and is re-issued) rather than stream them.
    raise RuntimeError(f"{name}: decode step {index} ran with a wrong DecodeHint"
                       " (host-side slot positions or version counts disagree with the device)")
  rows = slots.still_owned(step.owners)
  if step.result.routes is not None:
    # The step ran each row's previous token: its routes go to that position.
    routes = np.asarray(step.result.routes)
    for row in rows:
      s = slots.occupants[row]
      s.routes[s.context_len + int(slots.count[row]) - 1] = routes[row]
  return rows, data[rows, 0], logprobs[rows]
