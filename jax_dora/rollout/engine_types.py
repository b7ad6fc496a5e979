"""The engine's data: what crosses between the driver, the engine's facade and its programs.

Device pytrees (:class:`DecodeState`, :class:`Prefix`, the result tokens) and
the host-side descriptions of a step (:class:`MultiVersionParams`,
:class:`DecodeHint`, :class:`FirstToken`, :class:`PrefillWork`). No logic
beyond validation lives here, so the driver, the programs and the tests can
share these types without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.struct
import jax
import numpy as np

from jax_dora.jetstream_api import engine_api
from jax_dora.model import KVCache

Params = Any


@dataclasses.dataclass(frozen=True)
class MultiVersionParams:
  """Several policy versions for one ``generate`` call.

  Attributes:
    params: version -> param pytree (already on the engine's devices).
    live: versions to run this step (those pinned by at least one active
      slot). Passing only live versions keeps a step's cost proportional to
      the number of versions actually in use, usually one.
  """

  params: Mapping[int, Params]
  live: tuple[int, ...] = ()

  def __post_init__(self):
    missing = [v for v in self.live if v not in self.params]
    if missing:
      raise ValueError(f"live versions {missing} have no params (have {sorted(self.params)})")

  @property
  def newest(self) -> int:
    return max(self.params)

  @classmethod
  def single(cls, version: int, params: Params) -> "MultiVersionParams":
    return cls({int(version): params}, (int(version),))


@dataclasses.dataclass(frozen=True)
class DecodeHint:
  """What the host knows about a decode step, so its program can be static.

  The driver tracks every slot's position and version on the host; passing
  them here lets the engine pick, per step, a compiled program whose
  attention reads cache entries ``[0, bucket)`` only and whose per-version
  passes have fixed row counts, with no data-dependent ``while`` or ``cond``
  on the device (on a GPU those copy a predicate to the host and wait on it,
  and break command-buffer capture). Without a hint ``generate`` reads the
  same facts from the decode state (a device-to-host sync per step).

  Attributes:
    max_position: upper bound on every active slot's position this step
      (the index its pending token is written at; attention reads the
      entries below it).
    version_rows: version -> number of active slots pinned to it (an upper
      bound is fine).
  """

  max_position: int
  version_rows: Mapping[int, int]

  def advanced(self, steps: int = 1) -> "DecodeHint":
    """The hint ``steps`` decode steps later, with no slot admitted or freed
    (every active slot's position advances by one per step)."""
    return dataclasses.replace(self, max_position=self.max_position + int(steps))


@flax.struct.dataclass
class Prefix:
  """One prompt's prefill result, ready for :meth:`DoraEngine.insert`.

  ``cache`` is batch-1 but full ``max_seq_len`` long so insertion is a plain
  row copy. ``token`` (sampled from the last prompt position) is *not* yet in
  the cache: it is the next decode input, at position ``true_length``.
  """

  cache: KVCache
  token: jax.Array  # [] int32
  logprob: jax.Array  # [] float32
  true_length: jax.Array  # [] int32, tokens in the cache (prompt + resume prefix)
  version: jax.Array  # [] int32, policy version that computed it


@flax.struct.dataclass
class DecodeState:
  """Everything ``generate`` transforms, ``num_slots`` rows.

  ``tokens[i]`` is slot i's pending token (sampled, not yet written to the
  cache) and ``positions[i]`` the position it will be written at. ``version``
  is the policy the slot is pinned to (``-1`` = never filled).
  """

  cache: KVCache
  tokens: jax.Array  # [B] int32
  positions: jax.Array  # [B] int32
  lengths: jax.Array  # [B] int32, tokens generated in this slot so far
  version: jax.Array  # [B] int32
  active: jax.Array  # [B] bool
  rng: jax.Array  # PRNG key


@flax.struct.dataclass
class DoraResultTokens(engine_api.ResultTokens):
  """``ResultTokens`` plus the log-prob of each returned token, ``[B, 1]``."""

  logprobs: Any = None
  # [] bool: the step's DecodeHint was wrong (a row's position past the
  # attention bound, or more rows of a version than its pass holds), so
  # some row's result is wrong; the driver raises on it.
  hint_violated: Any = None
  # MoE: ``[B, moe_layers, k]`` the experts each row's input token was routed
  # to this step (``jax_dora.model.routing``); None for a dense model.
  routes: Any = None

  def convert_to_numpy(self) -> "DoraResultTokens":
    return DoraResultTokens(
        np.asarray(self.data),
        self.tokens_idx,
        self.valid_idx,
        self.length_idx,
        self.samples_per_slot,
        logprobs=None if self.logprobs is None else np.asarray(self.logprobs),
        hint_violated=None if self.hint_violated is None else np.asarray(self.hint_violated),
        routes=None if self.routes is None else np.asarray(self.routes),
    )

  def copy_to_host_async(self) -> None:
    super().copy_to_host_async()
    for extra in (self.logprobs, self.hint_violated, self.routes):
      if isinstance(extra, jax.Array):
        extra.copy_to_host_async()

  def get_logprobs_at_slot(self, slot: int) -> np.ndarray:
    start = slot * self.samples_per_slot
    return self.logprobs[start:start + self.samples_per_slot, 0]


class FirstToken(NamedTuple):
  """Where an admitted request's first sampled token is (nothing read back yet).

  ``values[row]`` = ``(token, logprob)``; for an MoE model
  ``routes[context]`` = its context's routes ``[T, moe_layers, k]`` (padded
  to the bucket). Routes come per distinct context, not per slot: a GRPO
  group's G members share one row, and the transfer stays within the call's
  ``prefill_batch_tokens`` (a per-slot copy would be ``num_slots x T`` rows).
  """

  values: jax.Array
  row: int
  routes: jax.Array | None = None
  context: int = 0
  # A held-context resume computed only the context's positions from
  # ``offset`` on: ``routes[context]`` starts there.
  offset: int = 0


@dataclasses.dataclass
class PrefillWork:
  """What one admission round's prefill computed (prefix-sharing metrics).

  ``requested_tokens``: context tokens of every admitted request;
  ``computed_tokens``: of the distinct contexts actually run (equal without
  sharing; about ``1/G`` of requested with GRPO groups of G);
  ``padded_tokens``: including bucket padding (the device work).
  """

  requests: int = 0
  requested_tokens: int = 0
  computed_tokens: int = 0
  padded_tokens: int = 0
  calls: int = 0

  def add(self, other: PrefillWork) -> None:
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def decode_result(data: jax.Array, logp: jax.Array, bad: jax.Array,
                  routes: jax.Array | None) -> DoraResultTokens:
  """A decode step's outputs as JetStream's ``ResultTokens``: ``data[B, 3]`` is
  (token, valid, length) per slot, one sample per slot."""
  return DoraResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                          samples_per_slot=1, logprobs=logp, hint_violated=bad, routes=routes)
