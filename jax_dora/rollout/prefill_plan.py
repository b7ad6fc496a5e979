"""Host-side planning of one admission round's prefill: which contexts are shared, the layout.

(Also the held-context resume's calls, :func:`plan_extend`: a multi-turn
turn whose context is kept in the held-KV pool prefills only its new tokens.)

An admission round hands the engine a list of contexts (prompt, or prompt +
resumed completion) and the slots they go to, all on one policy version. This
module turns that into the batched prefill calls the device runs, with numpy
only (nothing here touches the device or JAX):

* identical contexts (a GRPO group's G members) are computed once when
  prompt sharing is on, and their KV entries copied into each member's slot;
* contexts are grouped by padded length (``ProgramBuckets.prefill_length``)
  and cut into calls of at most ``prefill_rows(length)[-1]`` distinct rows,
  each padded to the smallest row bucket that holds it (static shapes);
* every slot gets its own first-token randomness (``counts``: the engine's
  prefill counter), so group members diverge from their first token and a
  request's randomness does not depend on what it was batched with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np

from jax_dora.rollout.buckets import ProgramBuckets
from jax_dora.rollout.engine_types import PrefillWork

T = TypeVar("T")


@dataclasses.dataclass
class PrefillCall:
  """One device call of the batched prefill program.

  ``tokens[U, T]`` / ``lengths[U]``: the distinct contexts, right-padded with
  PAD. ``src[N]``: which context row slot ``dst[N]`` receives (``N`` =
  num_slots; padding entries carry ``dst = num_slots`` and are dropped).
  ``counts[N]``: each entry's first-token key counter. ``users``: ``(request
  index, output row, context row)`` for every request of the call.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  src: np.ndarray
  dst: np.ndarray
  counts: np.ndarray
  users: list[tuple[int, int, int]]


def _calls(by_length: dict[int, list[T]], buckets: ProgramBuckets
           ) -> Iterator[tuple[int, list[T], int]]:
  """``(padded length, members, padded rows)`` of each device call: members grouped by
  padded length, cut into calls of at most ``prefill_rows(length)[-1]`` members, each padded
  to the smallest row bucket that holds it (static shapes)."""
  for t, members in sorted(by_length.items()):
    rows = buckets.prefill_rows(t)
    for lo in range(0, len(members), rows[-1]):
      part = members[lo:lo + rows[-1]]
      yield t, part, next(r for r in rows if r >= len(part))


def plan_prefill(contexts: Sequence[np.ndarray], slots: Sequence[int], buckets: ProgramBuckets,
                 *, pad_id: int, share_prompts: bool, next_count: Callable[[], int]
                 ) -> tuple[list[PrefillCall], PrefillWork]:
  """The calls that prefill ``contexts[i]`` into ``slots[i]``, and the work they do.

  Raises:
    ValueError: mismatched lengths, a repeated or out-of-range slot, or an
      empty or overlong context.
  """
  n_slots, max_len = buckets.num_slots, buckets.max_seq_len
  if len(contexts) != len(slots):
    raise ValueError(f"{len(contexts)} contexts for {len(slots)} slots")
  if len({int(s) for s in slots}) != len(slots):
    raise ValueError(f"slots {list(slots)} repeat")
  ctxs = [np.asarray(c, np.int32).reshape(-1) for c in contexts]
  for slot, c in zip(slots, ctxs):
    if not 0 <= int(slot) < n_slots:
      raise ValueError(f"slot {slot} out of range [0, {n_slots})")
    if not 0 < len(c) <= max_len:
      raise ValueError(f"context of {len(c)} tokens not in (0, {max_len}]")
  # Distinct contexts, each with the requests that use it, per length bucket.
  distinct: dict[bytes | int, tuple[np.ndarray, list[int]]] = {}
  for i, c in enumerate(ctxs):
    distinct.setdefault(c.tobytes() if share_prompts else i, (c, []))[1].append(i)
  by_length: dict[int, list[tuple[np.ndarray, list[int]]]] = {}
  for c, users in distinct.values():
    by_length.setdefault(buckets.prefill_length(len(c)), []).append((c, users))
  work = PrefillWork(requests=len(ctxs), requested_tokens=sum(len(c) for c in ctxs))
  calls = []
  for t, chunk, u in _calls(by_length, buckets):
    call = PrefillCall(tokens=np.full((u, t), pad_id, np.int32), lengths=np.ones((u,), np.int32),
                       src=np.zeros((n_slots,), np.int32),
                       dst=np.full((n_slots,), n_slots, np.int32),  # out of range = dropped
                       counts=np.zeros((n_slots,), np.uint32), users=[])
    row = 0
    for j, (c, users) in enumerate(chunk):
      call.tokens[j, :len(c)] = c
      call.lengths[j] = len(c)
      for i in users:
        call.src[row], call.dst[row], call.counts[row] = j, int(slots[i]), next_count()
        call.users.append((i, row, j))
        row += 1
    calls.append(call)
    work.calls += 1
    work.computed_tokens += sum(len(c) for c, _ in chunk)
    work.padded_tokens += u * t
  return calls, work


@dataclasses.dataclass
class ExtendCall:
  """One device call of the held-context resume program (``DeviceSteps.extend_batch``).

  Row ``r``: ``tokens[r, :lengths[r]]`` continue the context held in pool row
  ``pool_rows[r]`` (its first ``starts[r]`` entries) into slot ``slots[r]``;
  padding rows carry ``slots = num_slots`` (dropped). ``bound``: the static
  attention bound (a decode length holding every start). ``users``: ``(request
  index, row)``.
  """

  tokens: np.ndarray
  starts: np.ndarray
  lengths: np.ndarray
  pool_rows: np.ndarray
  slots: np.ndarray
  counts: np.ndarray
  bound: int
  users: list[tuple[int, int]]


def plan_extend(chunks: Sequence[np.ndarray], starts: Sequence[int], pool_rows: Sequence[int],
                slots: Sequence[int], buckets: ProgramBuckets, lengths: Sequence[int], *,
                pad_id: int, next_count: Callable[[], int]) -> tuple[list[ExtendCall], PrefillWork]:
  """The calls that resume ``chunks[i]`` after pool row ``pool_rows[i]``'s ``starts[i]``
  entries into ``slots[i]``; ``lengths``: the padded chunk lengths compiled
  (``EnginePrograms.extend_lengths``). Every chunk must fit one of them and its
  context the cache."""
  n_slots = buckets.num_slots
  by_length: dict[int, list[int]] = {}
  for i, c in enumerate(chunks):
    t = next((b for b in lengths if len(c) <= b), None)
    if t is None or not 0 < len(c) or starts[i] + len(c) > buckets.max_seq_len:
      raise ValueError(f"a chunk of {len(c)} tokens after {starts[i]} does not fit {lengths}")
    by_length.setdefault(t, []).append(i)
  work = PrefillWork(requests=len(chunks),
                     requested_tokens=sum(int(s) + len(c) for s, c in zip(starts, chunks)))
  calls = []
  for t, part, u in _calls(by_length, buckets):
    call = ExtendCall(tokens=np.full((u, t), pad_id, np.int32), starts=np.zeros((u,), np.int32),
                      lengths=np.ones((u,), np.int32), pool_rows=np.zeros((u,), np.int32),
                      slots=np.full((u,), n_slots, np.int32), counts=np.zeros((u,), np.uint32),
                      bound=buckets.decode_length(max(int(starts[i]) for i in part)), users=[])
    for r, i in enumerate(part):
      c = np.asarray(chunks[i], np.int32)
      call.tokens[r, :len(c)] = c
      call.starts[r], call.lengths[r] = int(starts[i]), len(c)
      call.pool_rows[r], call.slots[r], call.counts[r] = int(pool_rows[i]), int(slots[i]), next_count()
      call.users.append((i, r))
    calls.append(call)
    work.calls += 1
    work.computed_tokens += sum(len(chunks[i]) for i in part)
    work.padded_tokens += u * t
  return calls, work
