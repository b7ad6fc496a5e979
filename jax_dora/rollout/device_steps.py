"""The rollout engine's device computations, as pure JAX functions of arrays.

Each method here is traced into one compiled program by
:class:`~jax_dora.rollout.programs.EnginePrograms` (which owns the jit wrappers,
their shardings and the bucket tables); nothing here holds host-side request
state or compiles anything. The functions have fixed shapes: the decode state
always has ``num_slots`` rows and a full ``max_seq_len`` cache; prefill writes
``T`` positions of the slots it fills; decode reads the cache below a static
bound and, in a multi-version step, each version's pass runs a static number
of rows. Nothing branches or loops on device data (issue 23: on a GPU that
copies a predicate to the host and waits).

* **Batched prefill** computes ``U`` distinct contexts once and inserts them
  into ``N`` slots (a GRPO group's members share one context); JetStream's
  single-prompt ``prefill`` is the same computation into a one-slot state.
* **Multi-version decode**: every slot is pinned to the version that
  prefilled it (``DecodeState.version``); a step runs one pass per live
  version and each slot commits only its own version's pass, so a trajectory
  never mixes versions within a span.
* **Log-probs** of every sampled token (the learner's importance ratios) and,
  for an MoE policy, the experts each token was routed to (routing replay).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dora.model import KVCache, ModelConfig, Transformer, head_logits, head_weight, routing
from jax_dora.model.routing import ROUTING
from jax_dora.rollout.engine_types import DecodeState, Prefix
from jax_dora.rollout.sampling import sample_tokens


class DeviceSteps:
  """Prefill, insert, decode passes and slot bookkeeping for one model and sampler."""

  def __init__(self, model_cfg: ModelConfig, model: Transformer, *, temperature: float,
               top_p: float, suppress_mask: jax.Array):
    self.model_cfg = model_cfg
    self.model = model
    self.temperature = float(temperature)
    self.top_p = float(top_p)
    # The tokenizer decides which ids may never be sampled (PAD, BOS, non-stop
    # special tokens, padded vocabulary rows); the learner masks the same ids.
    self.suppress_mask = suppress_mask
    # MoE: every prefill and decode step also returns the experts each token
    # was routed to (routing replay; ``jax_dora.model.routing``).
    self.routing_shape = routing.routing_shape(model_cfg)

  def _sample(self, logits: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    return sample_tokens(logits, key, self.temperature, self.top_p, self.suppress_mask)

  # ------------------------------------------------------------------ state
  def init_state(self, rng: jax.Array, num_slots: int) -> DecodeState:
    b = int(num_slots)
    return DecodeState(
        cache=KVCache.zeros(self.model_cfg, b),
        tokens=jnp.zeros((b,), jnp.int32),
        positions=jnp.zeros((b,), jnp.int32),
        lengths=jnp.zeros((b,), jnp.int32),
        version=jnp.full((b,), -1, jnp.int32),
        active=jnp.zeros((b,), bool),
        rng=rng,
    )

  @staticmethod
  def free(state: DecodeState, slot) -> DecodeState:
    return state.replace(active=state.active.at[slot].set(False),
                         version=state.version.at[slot].set(-1))

  # ---------------------------------------------------------------- prefill
  def prefill_batch(self, params, state: DecodeState, tokens, true_lengths, src, slots, counts,
                    version, base_key):
    """Prefills ``U`` distinct contexts once and inserts them into ``N`` slots.

    ``tokens[U,T]`` / ``true_lengths[U]``: the distinct contexts, right-padded.
    ``src[N]``: which context slot ``slots[N]`` receives (a GRPO group's G
    members share one context: its prompt is computed once and its KV
    entries copied G times). Padding entries carry ``slots = num_slots`` and
    are dropped. Each slot samples its own first token with its own key
    (``fold_in(base_key, counts[i])``). Attention runs within each context (no
    cache read), and only the ``T`` written positions of each slot's cache row
    are touched, so prefill costs the prompt, not ``max_seq_len``.

    Returns the new state and ``((token, logprob) [N, 2], routes [U, T, moe_layers, k] | None)``.
    """
    u, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (u, t))
    routes = None
    if self.routing_shape is None:
      hidden, kv = self.model.apply({"params": params}, tokens, positions,
                                    method=Transformer.prefill)
    else:
      (hidden, kv), recorded = self.model.apply(
          {"params": params}, tokens, positions, method=Transformer.prefill, mutable=[ROUTING])
      routes = routing.collect(recorded, self.model_cfg)  # [U, T, moe_layers, k]
    # Only each context's last real position is sampled from: [U, V], not [U, T, V].
    last = jnp.take_along_axis(hidden, (true_lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = head_logits(last, head_weight(self.model_cfg, params),
                         self.model_cfg.final_logit_softcap)
    keys = jax.vmap(lambda c: jax.random.fold_in(base_key, c))(counts)
    tok, logp = jax.vmap(lambda lg, key: self._sample(lg[None], key))(logits[src], keys)
    tok, logp = tok[:, 0], logp[:, 0]
    at_slot, at_pos = slots[:, None], jnp.arange(t, dtype=jnp.int32)[None, :]
    at = (slice(None), at_slot, slice(None), at_pos)  # head-major cache: [L, B, Hkv, S, D]

    def entries(new: jax.Array, cache: jax.Array) -> jax.Array:
      # [L, N, T, Hkv, D] -> [N, T, L, Hkv, D]: advanced indices around a
      # slice put the broadcast (slot, position) axes first.
      return new[:, src].transpose(1, 2, 0, 3, 4).astype(cache.dtype)

    cache = KVCache(
        k=state.cache.k.at[at].set(entries(kv.k, state.cache.k), mode="drop"),
        v=state.cache.v.at[at].set(entries(kv.v, state.cache.v), mode="drop"),
    )
    new_state = state.replace(
        cache=cache,
        tokens=state.tokens.at[slots].set(tok, mode="drop"),
        positions=state.positions.at[slots].set(true_lengths[src], mode="drop"),
        lengths=state.lengths.at[slots].set(1, mode="drop"),
        version=state.version.at[slots].set(version, mode="drop"),
        active=state.active.at[slots].set(True, mode="drop"),
    )
    return new_state, (jnp.stack([tok.astype(jnp.float32), logp], axis=1), routes)

  def prefill_prefix(self, params, tokens, true_length, version, count, base_key) -> Prefix:
    """JetStream's single-prompt prefill: :meth:`prefill_batch` of one context into
    a one-slot state, returned as that slot's :class:`Prefix` (for ``insert_row``)."""
    one = self.init_state(base_key, 1)
    zero = jnp.zeros((1,), jnp.int32)
    state, (values, _) = self.prefill_batch(
        params, one, tokens[None], true_length[None], zero, zero, count[None], version, base_key)
    return Prefix(cache=state.cache, token=values[0, 0].astype(jnp.int32), logprob=values[0, 1],
                  true_length=true_length, version=version)

  @staticmethod
  def insert_row(prefix: Prefix, state: DecodeState, slot) -> DecodeState:
    """Copies a prefix's cache row into ``slot`` and pins the slot to its version."""
    def put_row(dst, src):
      start = (0, slot) + (0,) * (dst.ndim - 2)
      return jax.lax.dynamic_update_slice(dst, src.astype(dst.dtype), start)

    cache = KVCache(k=put_row(state.cache.k, prefix.cache.k), v=put_row(state.cache.v, prefix.cache.v))
    return state.replace(
        cache=cache,
        tokens=state.tokens.at[slot].set(prefix.token),
        positions=state.positions.at[slot].set(prefix.true_length),
        lengths=state.lengths.at[slot].set(1),
        version=state.version.at[slot].set(prefix.version),
        active=state.active.at[slot].set(True),
    )

  # ------------------------------------------------- held KV (multi-turn)
  @staticmethod
  def park(state: DecodeState, pool: KVCache, slot, pool_row, *, length: int) -> KVCache:
    """Copies entries ``[0, length)`` of ``slot``'s cache row into ``pool_row`` of the
    held-KV pool (``length`` static: a decode-length bucket)."""
    def copy(dst, src):
      row = jax.lax.dynamic_slice_in_dim(src, slot, 1, axis=1)[:, :, :, :length]
      return jax.lax.dynamic_update_slice(dst, row.astype(dst.dtype), (0, pool_row, 0, 0, 0))

    return KVCache(k=copy(pool.k, state.cache.k), v=copy(pool.v, state.cache.v))

  def extend_batch(self, params, state: DecodeState, pool: KVCache, tokens, starts,
                   true_lengths, pool_rows, slots, counts, version, base_key, *, bound: int):
    """Resumes ``U`` held contexts: each slot gets its pool row's entries back and
    prefills only its new tokens on top of them.

    Row ``u``: ``pool_rows[u]`` holds the context's first ``starts[u]`` entries
    (computed by ``version``, which the trajectory still holds); ``tokens[u,
    :true_lengths[u]]`` are the new tokens (the turn's last sampled token and the
    tool's observation) at positions ``starts[u]..``. The pool's entries
    ``[0, bound)`` are copied into ``slots[u]``'s row, the chunk attends to
    them and to itself (``Transformer.extend``), its entries are written
    after them and the slot samples its first token from the chunk's last
    real position, as after a prefill. Padding rows carry ``slots =
    num_slots`` (dropped). Returns the new state and ``((token, logprob)
    [U, 2], routes [U, T, moe_layers, k] | None)``.
    """
    u, t = tokens.shape
    n = state.tokens.shape[0]
    s = self.model_cfg.max_seq_len
    bound = min(int(bound), s)

    def restore(dst, src):
      return dst.at[:, slots, :, :bound].set(src[:, pool_rows, :, :bound].astype(dst.dtype),
                                             mode="drop")

    cache = KVCache(k=restore(state.cache.k, pool.k), v=restore(state.cache.v, pool.v))
    rows = jnp.minimum(slots, n - 1)
    offsets = jnp.arange(t, dtype=jnp.int32)
    positions = starts[:, None] + offsets[None, :]
    routes = None
    if self.routing_shape is None:
      hidden, kv = self.model.apply({"params": params}, tokens, positions, cache, rows, bound,
                                    method=Transformer.extend)
    else:
      (hidden, kv), recorded = self.model.apply(
          {"params": params}, tokens, positions, cache, rows, bound, method=Transformer.extend,
          mutable=[ROUTING])
      routes = routing.collect(recorded, self.model_cfg)  # [U, T, moe_layers, k]
    last = jnp.take_along_axis(hidden, (true_lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = head_logits(last, head_weight(self.model_cfg, params),
                         self.model_cfg.final_logit_softcap)
    keys = jax.vmap(lambda c: jax.random.fold_in(base_key, c))(counts)
    tok, logp = jax.vmap(lambda lg, key: self._sample(lg[None], key))(logits, keys)
    tok, logp = tok[:, 0], logp[:, 0]
    # The chunk's real entries go after the context; padding positions (and
    # padding rows, slot = n) are dropped.
    write_at = jnp.where(offsets[None, :] < true_lengths[:, None], positions, s)
    at = (slice(None), slots[:, None], slice(None), write_at)

    def entries(new: jax.Array, dst: jax.Array) -> jax.Array:
      return new.transpose(1, 2, 0, 3, 4).astype(dst.dtype)  # [L,U,T,Hkv,D] -> [U,T,L,Hkv,D]

    cache = KVCache(k=cache.k.at[at].set(entries(kv.k, cache.k), mode="drop"),
                    v=cache.v.at[at].set(entries(kv.v, cache.v), mode="drop"))
    new_state = state.replace(
        cache=cache,
        tokens=state.tokens.at[slots].set(tok, mode="drop"),
        positions=state.positions.at[slots].set(starts + true_lengths, mode="drop"),
        lengths=state.lengths.at[slots].set(1, mode="drop"),
        version=state.version.at[slots].set(version, mode="drop"),
        active=state.active.at[slots].set(True, mode="drop"),
    )
    return new_state, (jnp.stack([tok.astype(jnp.float32), logp], axis=1), routes)

  # ----------------------------------------------------------------- decode
  # A decode step's accumulators: the new k/v entries ``[L,B,1,H,D]``, the
  # sampled tokens and log-probs ``[B]``, which rows some pass owned, and
  # whether the host's hint was violated. Passes only read ``state.cache``;
  # the step commits every owned row's entry once, in place
  # (``KVCache.write_step``), so a pass costs its rows' compute and never a
  # copy of the cache.
  def empty_acc(self, state: DecodeState):
    cfg = self.model_cfg
    b = state.tokens.shape[0]
    shape = (cfg.n_layers, b, 1, cfg.n_kv_heads, cfg.head_dim)
    new = KVCache(k=jnp.zeros(shape, state.cache.k.dtype), v=jnp.zeros(shape, state.cache.v.dtype))
    routes = None
    if self.routing_shape is not None:
      routes = jnp.full((b,) + self.routing_shape, routing.sentinel(cfg.num_experts),
                        routing.routing_dtype(cfg.num_experts))
    return (new, state.tokens, jnp.zeros((b,), jnp.float32), jnp.zeros((b,), bool),
            jnp.zeros((), bool), routes)

  @staticmethod
  def _version_key(state: DecodeState, version) -> jax.Array:
    """The sampling key of ``version``'s rows this step (the same in the
    fused single-version program and in a multi-version pass)."""
    return jax.random.fold_in(jax.random.split(state.rng)[0], version)

  def _decode_apply(self, params, tokens, positions, cache, rows, bound: int):
    """``((logits, new entries), routes)``: the model's decode of ``tokens [R, 1]``;
    ``routes [R, moe_layers, k]`` the experts each token went to (None: dense)."""
    if self.routing_shape is None:
      return self.model.apply({"params": params}, tokens, positions, cache, rows=rows,
                              kv_bound=bound, method=Transformer.decode), None
    out, recorded = self.model.apply({"params": params}, tokens, positions, cache, rows=rows,
                                     kv_bound=bound, method=Transformer.decode,
                                     mutable=[ROUTING])
    return out, routing.collect(recorded, self.model_cfg)[:, 0]

  def _decode_full(self, params, state: DecodeState, acc, version, bound: int):
    """One decode pass of ``version`` over every slot; keeps the rows pinned to it.

    Rows of other versions run too (a full pass is cheaper than gathering
    when ``version`` holds most slots) and are discarded.
    """
    acc_new, acc_tokens, acc_logp, owned, bad, acc_routes = acc
    (logits, new), routes = self._decode_apply(
        params, state.tokens[:, None], state.positions[:, None], state.cache, None, bound)
    tok, logp = self._sample(logits[:, 0], self._version_key(state, version))
    mine = state.active & (state.version == version)
    sel = mine[None, :, None, None, None]
    acc_new = KVCache(k=jnp.where(sel, new.k, acc_new.k), v=jnp.where(sel, new.v, acc_new.v))
    bad = bad | jnp.any(mine & (state.positions > bound))
    if routes is not None:
      acc_routes = jnp.where(mine[:, None, None], routes, acc_routes)
    return (acc_new, jnp.where(mine, tok, acc_tokens), jnp.where(mine, logp, acc_logp),
            owned | mine, bad, acc_routes)

  def _decode_rows(self, params, state: DecodeState, acc, version, size: int, bound: int):
    """Like :meth:`_decode_full`, but computes only the (at most ``size``) rows
    pinned to ``version``, gathered into a smaller batch.

    Under DORA every live version's rows need their own pass; a full pass
    over every slot per version would multiply the decode cost by the number
    of live versions, while the rows themselves add up to one batch.
    """
    acc_new, acc_tokens, acc_logp, owned, bad, acc_routes = acc
    b = state.tokens.shape[0]
    mine = state.active & (state.version == version)
    idx = jnp.nonzero(mine, size=size, fill_value=b)[0]  # b = padding
    rows = jnp.minimum(idx, b - 1)
    # The full cache goes in with the row indices: attention reads only those
    # rows' entries below the bound instead of a gathered copy of whole rows.
    (logits, new), routes = self._decode_apply(
        params, state.tokens[rows][:, None], state.positions[rows][:, None], state.cache, rows,
        bound)
    tok, logp = self._sample(logits[:, 0], self._version_key(state, version))
    acc_new = KVCache(
        k=acc_new.k.at[:, idx].set(new.k, mode="drop"),
        v=acc_new.v.at[:, idx].set(new.v, mode="drop"),
    )
    bad = bad | (jnp.sum(mine) > size) | jnp.any(mine & (state.positions > bound))
    if routes is not None:
      acc_routes = acc_routes.at[idx].set(routes, mode="drop")
    return (acc_new, acc_tokens.at[idx].set(tok, mode="drop"),
            acc_logp.at[idx].set(logp, mode="drop"), owned | mine, bad, acc_routes)

  def decode_pass(self, params, state: DecodeState, acc, version, *, size: int, bound: int):
    """One version's pass of a multi-version step (``size`` rows; all slots = a full pass)."""
    if size >= state.tokens.shape[0]:
      return self._decode_full(params, state, acc, version, bound)
    return self._decode_rows(params, state, acc, version, size, bound)

  def finish_step(self, state: DecodeState, acc):
    """Commits a step's passes: one in-place cache write, positions and lengths advance."""
    new, tokens, logp, owned, bad, routes = acc
    s = self.model_cfg.max_seq_len
    active = state.active
    # ``tokens >= 0`` is always true, but it makes the in-place cache write
    # depend on the sampled tokens, i.e. on the last layer's attention:
    # otherwise XLA may schedule the write before a later layer has read the
    # cache and then copies the whole cache every step to keep both (an
    # optimization_barrier does not survive the CPU pipeline).
    cache = state.cache.write_step(new, state.positions, owned & (tokens >= 0))
    # Rows at the cache end stop advancing (their writes are dropped); the
    # driver ends such sequences with "length".
    positions = jnp.where(active, jnp.minimum(state.positions + 1, s), state.positions)
    lengths = jnp.where(active, state.lengths + 1, state.lengths)
    new_state = state.replace(cache=cache, tokens=tokens, positions=positions, lengths=lengths,
                              rng=jax.random.split(state.rng)[1])
    data = jnp.stack([tokens, active.astype(jnp.int32), lengths], axis=1)
    return new_state, data, logp[:, None], bad, routes

  def single_version_step(self, params, state: DecodeState, version, *, bound: int):
    """The common one-live-version case: one pass, one in-place commit."""
    acc = self._decode_full(params, state, self.empty_acc(state), version, bound)
    return self.finish_step(state, acc)
