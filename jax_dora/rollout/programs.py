"""The rollout engine's compiled programs: one object that builds, compiles and picks them.

:class:`EnginePrograms` wraps every :class:`~jax_dora.rollout.device_steps.DeviceSteps`
function in ``jax.jit`` with the server's shardings (:class:`~jax_dora.rollout.placement.EnginePlacement`),
compiles all of them ahead of time (:meth:`EnginePrograms.warmup`: every
prefill length x row bucket, every decode length, and with several versions
every pass shape), and answers "which program for this step" from the host's
facts through the bucket tables (:class:`~jax_dora.rollout.buckets.ProgramBuckets`):
a decode step's static attention bound from the highest slot position, each
live version's pass size from its row count. Inputs the programs consume are
donated (the decode state is updated in place). A new kernel or sampler is a
change to ``DeviceSteps``; a new bucket policy a change to ``ProgramBuckets``;
this class only wires them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dora.model import KVCache
from jax_dora.rollout.buckets import ProgramBuckets
from jax_dora.rollout.device_steps import DeviceSteps
from jax_dora.rollout.engine_types import DecodeHint, DecodeState, MultiVersionParams, Params, Prefix
from jax_dora.rollout.placement import EnginePlacement
from jax_dora.rollout.prefill_plan import ExtendCall, PrefillCall


def _with_shardings(shapes, shardings):
  """``ShapeDtypeStruct`` leaves of ``shapes`` placed on ``shardings`` (for AOT lowering)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      shapes, shardings)


class EnginePrograms:
  """Every device program of one server, compiled once per bucket."""

  def __init__(self, steps: DeviceSteps, placement: EnginePlacement, buckets: ProgramBuckets):
    self.steps = steps
    self.placement = placement
    self.buckets = buckets
    st, r = placement.state, placement.replicated
    result = (st, r, r, r, r)
    self._prefill = jax.jit(steps.prefill_batch, donate_argnums=(1,), out_shardings=(st, r))
    self._prefill_prefix = jax.jit(steps.prefill_prefix, out_shardings=placement.prefix)
    self._insert = jax.jit(steps.insert_row, donate_argnums=(1,), out_shardings=st)
    # Static attention bound: one program per decode length, none with a
    # data-dependent loop or branch.
    self._single = jax.jit(steps.single_version_step, static_argnames=("bound",),
                           donate_argnums=(1,), out_shardings=result)
    # Several live versions: one dispatch per version's pass (a program per
    # pass size x decode length, whatever the number of versions), each
    # updating the donated accumulators in place, then one commit.
    self._acc_sharding = placement.step_accumulators(routed=steps.routing_shape is not None)
    self._empty_acc = jax.jit(steps.empty_acc, out_shardings=self._acc_sharding)
    self._pass = jax.jit(steps.decode_pass, static_argnames=("size", "bound"),
                         donate_argnums=(2,), out_shardings=self._acc_sharding)
    self._finish = jax.jit(steps.finish_step, donate_argnums=(0,), out_shardings=result)
    # Multi-turn: a held turn's cache row parked in the pool, and resumed from it.
    self._park = jax.jit(steps.park, static_argnames=("length",), donate_argnums=(1,))
    self._extend = jax.jit(steps.extend_batch, static_argnames=("bound",), donate_argnums=(1,),
                           out_shardings=(st, r))
    self._init = jax.jit(steps.init_state, static_argnums=(1,), out_shardings=st)
    self._free = jax.jit(steps.free, donate_argnums=(0,), out_shardings=st)

  # ------------------------------------------------------------- compiling
  def abstract_state(self) -> DecodeState:
    shapes = jax.eval_shape(lambda key: self.steps.init_state(key, self.buckets.num_slots),
                            jax.random.PRNGKey(0))
    return _with_shardings(shapes, self.placement.state)

  def lower_prefill(self, rows: int, length: int):
    """The batched prefill program for ``rows`` contexts of padded ``length``, lowered
    with abstract arguments (``.compile()`` it; nothing runs)."""
    n = self.buckets.num_slots
    per_slot = jax.ShapeDtypeStruct((n,), jnp.int32)
    return self._prefill.lower(
        self.placement.abstract_params(), self.abstract_state(),
        jax.ShapeDtypeStruct((rows, length), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
        per_slot, per_slot, jax.ShapeDtypeStruct((n,), jnp.uint32), np.int32(0),
        jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self.placement.replicated))

  def abstract_pool(self, rows: int) -> KVCache:
    shapes = jax.eval_shape(lambda: KVCache.zeros(self.steps.model_cfg, rows))
    return _with_shardings(shapes, self.placement.held_pool(rows))

  def init_pool(self, rows: int) -> KVCache:
    """The held-KV pool: ``rows`` cache rows beside the decode state's."""
    return jax.jit(lambda: KVCache.zeros(self.steps.model_cfg, rows),
                   out_shardings=self.placement.held_pool(rows))()

  def lower_extend(self, pool_rows: int, rows: int, length: int, bound: int):
    """The held-context resume program (``rows`` chunks of padded ``length``, attention
    bound ``bound``) for a pool of ``pool_rows``, lowered."""
    per_row = jax.ShapeDtypeStruct((rows,), jnp.int32)
    return self._extend.lower(
        self.placement.abstract_params(), self.abstract_state(), self.abstract_pool(pool_rows),
        jax.ShapeDtypeStruct((rows, length), jnp.int32), per_row, per_row, per_row, per_row,
        jax.ShapeDtypeStruct((rows,), jnp.uint32), np.int32(0),
        jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self.placement.replicated), bound=bound)

  def warmup_held(self, pool_rows: int) -> None:
    """Compiles the park and resume programs of a ``pool_rows`` pool: every decode length
    (park, resume bound) x the resume chunk's length and row buckets."""
    state, pool = self.abstract_state(), self.abstract_pool(pool_rows)
    for bound in self.buckets.decode_lengths:
      self._park.lower(state, pool, np.int32(0), np.int32(0), length=bound).compile()
      for t in self.extend_lengths():
        for u in self.buckets.prefill_rows(t):
          self.lower_extend(pool_rows, u, t, bound).compile()

  def extend_lengths(self) -> tuple[int, ...]:
    """Padded chunk lengths of a held-context resume: the prefill lengths up to half the
    cache (a longer chunk is a long observation: it re-prefills instead)."""
    half = self.buckets.max_seq_len // 2
    return tuple(t for t in self.buckets.prefill_lengths if t <= half) or (
        self.buckets.prefill_lengths[0],)

  def lower_decode(self, bound: int):
    """The single-version decode program at attention bound ``bound``, lowered."""
    return self._single.lower(self.placement.abstract_params(), self.abstract_state(),
                              np.int32(0), bound=bound)

  def warmup(self, max_versions: int) -> None:
    """Compiles every program the driver can call: batched prefill at every
    length x row bucket, decode at every length (and, with ``max_versions`` >
    1, every multi-version pass shape) and slot freeing.

    Without it the first step that meets a second (third, ...) live version
    or a resumed request's longer prefill bucket compiles mid-run, stalling
    every slot of the server for seconds. Lowering uses abstract params and
    never executes, so no decode state is consumed.
    """
    for t in self.buckets.prefill_lengths:
      for u in self.buckets.prefill_rows(t):
        self.lower_prefill(u, t).compile()
    self.warmup_decode(max_versions)
    self._free.lower(self.abstract_state(), np.int32(0)).compile()

  def warmup_decode(self, max_versions: int) -> None:
    """The decode part of :meth:`warmup`."""
    params, state, i32 = self.placement.abstract_params(), self.abstract_state(), np.int32(0)
    for bound in self.buckets.decode_lengths:
      self.lower_decode(bound).compile()
    if int(max_versions) > 1:
      acc = _with_shardings(jax.eval_shape(self.steps.empty_acc, state), self._acc_sharding)
      self._empty_acc.lower(state).compile()
      for size in self.buckets.pass_rows:
        for bound in self.buckets.decode_lengths:
          self._pass.lower(params, state, acc, i32, size=size, bound=bound).compile()
      self._finish.lower(state, acc).compile()

  def compiled(self) -> dict[str, int]:
    """Executables compiled so far per program (one per bucket: the "compiles once" check)."""
    fns = {"prefill": self._prefill, "prefill_prefix": self._prefill_prefix,
           "park": self._park, "extend": self._extend,
           "insert": self._insert, "decode": self._single, "decode_pass": self._pass,
           "decode_commit": self._finish, "free": self._free}
    return {name: fn._cache_size() for name, fn in fns.items()}  # pylint: disable=protected-access

  def decode_traces(self, params: Params, state: DecodeState, version: int) -> list:
    """Every decode program at every bucket, traced (not compiled): what a test walks
    to check that none loops or branches on device data."""
    v, out = np.int32(version), []
    acc = self._empty_acc(state)
    for bound in self.buckets.decode_lengths:
      out.append(self._single.trace(params, state, v, bound=bound))
      for size in self.buckets.pass_rows:
        out.append(self._pass.trace(params, state, acc, v, size=size, bound=bound))
    out.append(self._finish.trace(state, acc))
    return out

  # ---------------------------------------------------------------- running
  def init_state(self, rng: jax.Array) -> DecodeState:
    return self._init(rng, self.buckets.num_slots)

  def free(self, state: DecodeState, slot: int) -> DecodeState:
    return self._free(state, jnp.int32(slot))

  def prefill(self, params: Params, state: DecodeState, call: PrefillCall, version: int,
              base_key: jax.Array):
    """Runs one planned batched prefill call (``state`` donated)."""
    return self._prefill(params, state, call.tokens, call.lengths, call.src, call.dst,
                         call.counts, np.int32(version), base_key)

  def park(self, state: DecodeState, pool: KVCache, slot: int, pool_row: int,
           length: int) -> KVCache:
    """Copies ``slot``'s first ``length`` entries (a decode-length bucket) into the pool."""
    return self._park(state, pool, np.int32(slot), np.int32(pool_row), length=length)

  def extend(self, params: Params, state: DecodeState, pool: KVCache, call: ExtendCall,
             version: int, base_key: jax.Array):
    """Runs one planned held-context resume call at its bound (``state`` donated)."""
    return self._extend(params, state, pool, call.tokens, call.starts, call.lengths,
                        call.pool_rows, call.slots, call.counts, np.int32(version), base_key,
                        bound=call.bound)

  def prefill_prefix(self, params: Params, tokens: jax.Array, true_length: int, version: int,
                     count: int, base_key: jax.Array) -> Prefix:
    return self._prefill_prefix(params, tokens, jnp.int32(true_length), jnp.int32(version),
                                jnp.uint32(count), base_key)

  def insert(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
    return self._insert(prefix, state, jnp.int32(slot))

  def decode(self, params: MultiVersionParams, live: tuple[int, ...], state: DecodeState,
             hint: DecodeHint):
    """One decode step of every live version, on the programs ``hint`` selects.

    One live version: the fused single-pass program. Several: one pass per
    version over that version's rows, gathered into the smallest pass size
    that holds the host's count (a full pass when it holds more than half
    the slots), so K live versions cost about one pass over the slots rather
    than K; then one commit.
    """
    bound = self.buckets.decode_length(int(hint.max_position))
    if len(live) == 1:
      v = live[0]
      return self._single(params.params[v], state, np.int32(v), bound=bound)
    acc = self._empty_acc(state)
    for v in live:
      size = self.buckets.pass_size(int(hint.version_rows.get(v, self.buckets.num_slots)))
      acc = self._pass(params.params[v], state, acc, np.int32(v), size=size, bound=bound)
    return self._finish(state, acc)
