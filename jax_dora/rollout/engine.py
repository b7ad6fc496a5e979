"""JetStream ``Engine`` for the jax-dora Transformer, with multi-version decode.

The engine is the accelerator half of a rollout server (JetStream's split):
``prefill`` computes one prompt's KV cache and first token, ``insert`` copies it
into a free decode slot, ``generate`` advances every slot by one token. Two
things differ from a stock JetStream engine:

* **Multi-version decode.** ``generate`` takes a :class:`MultiVersionParams`
  (several policy versions at once). Every slot is *pinned* to the version that
  prefilled it (``DecodeState.version``); one decode pass is run per live
  version and each slot commits only the pass of its own version. A trajectory
  therefore never mixes versions within a span by construction, while a single
  server can keep old trajectories running after a new policy arrives (DORA).
* **Log-probs.** :class:`DoraResultTokens` carries the behaviour log-prob of
  every sampled token, which the learner needs for importance ratios; for an
  MoE policy it also carries the experts each fed token was routed to, and
  the batched prefill the prompt's (routing replay, ``jax_dora.model.routing``).

Every device function is jitted with fixed shapes: the decode state always has
``num_slots`` rows and a full ``max_seq_len`` cache, the slot index passed to
``insert`` is a traced scalar, and prefill pads to a small set of length
buckets, so each function compiles once (per bucket) and never again.

Placement: the engine builds a ``("slots", "tensor")`` mesh over the
server's devices, ``tensor_parallel`` devices on the second axis. Params are
laid out by the model's logical axes with heads, KV heads, MLP width and
vocabulary over ``"tensor"`` (Megatron-style tensor parallelism, so a 7B-class
policy fits a server of small chips) and replicated over ``"slots"``; with
``tensor_parallel=1`` they are fully replicated and decode needs no
collective. The decode state's slot (batch) axis is sharded over ``"slots"``
when ``num_slots`` divides evenly, the KV cache's heads over ``"tensor"``;
prefixes (batch 1) follow the same head split.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dora.jetstream_api import engine_api, tokenizer_pb2
from jax_dora.model import (
    DECODE_ATTENTION,
    KVCache,
    ModelConfig,
    Transformer,
    head_logits,
    head_weight,
    param_logical_specs,
    stack_layers,
    suppress_mask,
)
from jax_dora.model import abstract_params as model_abstract_params
from jax_dora.model import routing
from jax_dora.model.routing import ROUTING
from jax_dora.model.tokenizer import PolicyTokenizer
from jax_dora.rollout.sampling import sample_tokens
from jax_dora.snapshots import SnapshotReader, abstract_target_like

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


def _smallest_holding(buckets: Sequence[int], n: int) -> int | None:
  """The first of the ascending ``buckets`` that is ``>= n`` (None: none is)."""
  return next((b for b in buckets if n <= b), None)


def _with_shardings(shapes: Any, shardings: Any) -> Any:
  """``ShapeDtypeStruct`` leaves of ``shapes`` placed on ``shardings`` (for AOT lowering)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      shapes, shardings)


def decode_length_buckets(max_seq_len: int, smallest: int = 0) -> tuple[int, ...]:
  """Static attention bounds of decode steps: doubling up to ``max_seq_len``.

  Starts at ``max(128, max_seq_len // 32)`` unless ``smallest`` is given, so
  a cache has at most six buckets (six compiled programs per pass shape; one
  for caches of up to 160 entries) and a step past the first bucket reads at
  most 2.5x the entries its longest live row needs (the last doubling is
  dropped when ``max_seq_len`` is within 1.25x of it).
  """
  b = max(1, min(int(smallest) or max(128, max_seq_len // 32), max_seq_len))
  out = []
  while b < max_seq_len:
    out.append(b)
    b *= 2
  if out and max_seq_len <= 1.25 * out[-1]:
    out.pop()  # 2048 next to 2400: a program of its own for a <= 25% shorter read
  out.append(max_seq_len)
  return tuple(out)


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


def prefill_buckets(max_prefill_length: int, max_seq_len: int) -> tuple[int, ...]:
  """Padded prefill lengths: ``max_prefill_length`` doubling up to ``max_seq_len``.

  Fresh prompts fit the first bucket; resumed requests (prompt + an
  interrupted completion) need the longer ones. Few buckets = few compiles.
  """
  out = []
  b = max(1, min(max_prefill_length, max_seq_len))
  while b < max_seq_len:
    out.append(b)
    b *= 2
  out.append(max_seq_len)
  return tuple(out)


class DoraEngine(engine_api.Engine):
  """Prefill / insert / multi-version generate for :class:`Transformer`."""

  def __init__(
      self,
      model_cfg: ModelConfig,
      tokenizer: PolicyTokenizer,
      num_slots: int,
      max_prefill_length: int,
      devices: Sequence[jax.Device] | None = None,
      temperature: float = 1.0,
      top_p: float = 1.0,
      seed: int = 0,
      tensor_parallel: int = 1,
      decode_attention: str = "blocked",
      attention_block: int = 0,
      prefill_batch_tokens: int = 4096,
      share_prompt_prefill: bool = True,
      length_buckets: Sequence[int] = (),
      scan_layers: bool = False,
  ):
    if num_slots < 1:
      raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_prefill_length > model_cfg.max_seq_len:
      raise ValueError(
          f"max_prefill_length={max_prefill_length} > max_seq_len={model_cfg.max_seq_len}"
      )
    if decode_attention not in DECODE_ATTENTION:
      raise ValueError(f"decode_attention={decode_attention!r} is not one of {DECODE_ATTENTION}")
    if attention_block < 0 or prefill_batch_tokens < 1:
      raise ValueError(f"attention_block={attention_block} must be >= 0 and prefill_batch_tokens="
                       f"{prefill_batch_tokens} >= 1")
    self.model_cfg = model_cfg
    # MoE: every prefill and decode step also returns the experts each token
    # was routed to (routing replay; ``jax_dora.model.routing``).
    self.routing_shape = routing.routing_shape(model_cfg)
    self.tokenizer = tokenizer
    # scan_layers: prefill and decode programs loop over one compiled block
    # (DESIGN.md, Scanning over layers). Snapshots keep the per-layer layout;
    # load_params / place_params stack it once per version.
    self.scan_layers = bool(scan_layers)
    self.model = Transformer(model_cfg, decode_attention=decode_attention,
                             attention_block=int(attention_block), scan_layers=self.scan_layers)
    self.decode_attention = decode_attention
    self.share_prompt_prefill = bool(share_prompt_prefill)
    self._prefill_batch_tokens = int(prefill_batch_tokens)
    self.temperature = float(temperature)
    self.top_p = float(top_p)
    # The tokenizer decides which ids may never be sampled (PAD, BOS, non-stop
    # special tokens, padded vocabulary rows); the learner masks the same ids.
    self.suppress_mask = suppress_mask(
        model_cfg.vocab_size, tokenizer.suppressed_ids(model_cfg.vocab_size))
    self._num_slots = int(num_slots)
    self._max_prefill_length = int(max_prefill_length)
    self.buckets = prefill_buckets(self._max_prefill_length, model_cfg.max_seq_len)
    devices = list(devices) if devices else jax.devices()[:1]
    tp = int(tensor_parallel)
    if tp < 1 or len(devices) % tp:
      raise ValueError(f"tensor_parallel={tp} does not divide the server's {len(devices)} devices")
    split = ("n_heads", "n_kv_heads", "d_ff", "vocab_size")
    if model_cfg.num_experts:
      split += ("num_experts",)  # an MoE layer's experts are divided among the chips
    if model_cfg.shared_expert_d_ff:
      split += ("shared_expert_d_ff",)
    for name in split:
      if getattr(model_cfg, name) % tp:
        raise ValueError(f"model.{name}={getattr(model_cfg, name)} is not divisible by"
                         f" rollout.tensor_parallel={tp}")
    self._mesh = Mesh(np.array(devices).reshape(len(devices) // tp, tp), ("slots", "tensor"))
    self.replicated = NamedSharding(self._mesh, P())
    self._heads_axis = "tensor" if tp > 1 else None
    # The per-layer (snapshot, checkpoint) layout's shardings, and the
    # programs' (stacked under "layers" with scan_layers).
    self.param_sharding = self._param_sharding(stacked=False)
    self._program_param_sharding = self._param_sharding(stacked=self.scan_layers)
    slot_axis = "slots" if num_slots % (len(devices) // tp) == 0 else None
    self._slot_axis = slot_axis
    self._prefix_cache_sharding = NamedSharding(self._mesh, P(None, None, self._heads_axis))
    self._state_sharding = self._decode_state_sharding(slot_axis)
    # Prefill draws its first-token randomness from a host-side counter (the
    # JetStream prefill signature has no rng argument); a lock keeps the
    # counter consistent if several threads prefill.
    # On the engine's devices (not the default device, which may be the
    # learner's): keys derived from it need no transfer, and warmup's
    # abstract key matches them.
    self._base_key = jax.device_put(jax.random.PRNGKey(seed), self.replicated)
    self._prefill_count = 0
    self._rng_lock = threading.Lock()
    self._abstract_params: Params | None = None
    self._snapshot_abstract: Params | None = None
    self._stack_fn = None
    # Gathered sub-batch sizes for a version's rows (see
    # _multi_version_step): slots/8, /4, /2, then a full pass.
    self._row_buckets = tuple(sorted(
        {max(1, self._num_slots // d) for d in (8, 4, 2)} - {self._num_slots})) + (self._num_slots,)
    s = model_cfg.max_seq_len
    self.length_buckets = (tuple(sorted({min(int(b), s) for b in length_buckets} | {s}))
                           if length_buckets else decode_length_buckets(s))
    if decode_attention == "dense":  # reads the whole cache whatever the bound
      self.length_buckets = (s,)
    if self.length_buckets[0] < 1:
      raise ValueError(f"length_buckets {tuple(length_buckets)} must be >= 1")
    self._build_jitted()

  # ---------------------------------------------------------------- placement
  def _param_sharding(self, stacked: bool) -> Params:
    """Per-param shardings: model-parallel axes over ``"tensor"``, the rest
    replicated; ``stacked``: of the scanned layout (``stack_layers``).

    An MoE layer's experts are split over the chips (``expert`` first: a
    mesh axis is used once per array, so an expert's own ``mlp`` axis then
    stays whole on its chip, and each chip runs its own experts' matmuls)."""
    rules = tuple((name, self._heads_axis)
                  for name in ("vocab", "heads", "kv_heads", "expert", "mlp"))
    rules += tuple((name, None) for name in ("embed", "kv", "norm", "layers"))
    specs = param_logical_specs(self.model_cfg)
    if stacked:
      specs = stack_layers(specs, self.model_cfg.n_layers)
    with nn.logical_axis_rules(rules):
      return nn.logical_to_mesh_sharding(specs, self._mesh, rules)

  def _decode_state_sharding(self, slot_axis: str | None) -> DecodeState:
    row = NamedSharding(self._mesh, P(slot_axis))
    cache = NamedSharding(self._mesh, P(None, slot_axis, self._heads_axis))
    return DecodeState(
        cache=KVCache(k=cache, v=cache),
        tokens=row,
        positions=row,
        lengths=row,
        version=row,
        active=row,
        rng=self.replicated,
    )

  def _build_jitted(self) -> None:
    self._prefill_fn = jax.jit(self._prefill_impl, out_shardings=self._prefix_sharding())
    self._insert_fn = jax.jit(
        self._insert_impl, donate_argnums=(1,), out_shardings=self._state_sharding
    )
    st = self._state_sharding
    self._prefill_batch_fn = jax.jit(
        self._prefill_batch_impl, donate_argnums=(1,),
        out_shardings=(st, self.replicated),
    )
    r = self.replicated
    result_sharding = (st, r, r, r, r)
    # Static attention bound (and row count): one program per length bucket,
    # none with a data-dependent loop or branch.
    self._single_fn = jax.jit(
        self._single_version_step_impl, static_argnames=("bound",), donate_argnums=(1,),
        out_shardings=result_sharding)
    # Several live versions: one dispatch per version's pass (a program per
    # row bucket x length bucket, whatever the number of versions), each
    # updating the donated accumulators in place, then one commit.
    acc = self._acc_sharding()
    self._empty_acc_fn = jax.jit(self._empty_step_acc, out_shardings=acc)
    self._pass_fn = jax.jit(
        self._decode_pass_impl, static_argnames=("size", "bound"), donate_argnums=(2,),
        out_shardings=acc)
    self._finish_fn = jax.jit(
        self._finish_step_impl, donate_argnums=(0,), out_shardings=result_sharding)
    self._init_fn = jax.jit(self._init_impl, out_shardings=st)
    self._free_fn = jax.jit(self._free_impl, donate_argnums=(0,), out_shardings=st)

  def _acc_sharding(self):
    """Shardings of a decode step's accumulators (see ``_empty_step_acc``)."""
    st = self._state_sharding
    # New entries are [L, B, 1, Hkv, D] (not the cache's head-major layout).
    new = NamedSharding(self._mesh, P(None, self._slot_axis, None, self._heads_axis))
    routes = None if self.routing_shape is None else st.tokens  # [B, moe_layers, k]
    return (KVCache(k=new, v=new), st.tokens, st.tokens, st.tokens, self.replicated, routes)

  # ------------------------------------------------------------------- params
  def _prefix_sharding(self) -> Prefix:
    cache = self._prefix_cache_sharding
    r = self.replicated
    return Prefix(cache=KVCache(k=cache, v=cache), token=r, logprob=r, true_length=r, version=r)

  def abstract_params(self) -> Params:
    """Shape/dtype/sharding of the params the engine's programs take (what
    ``load_params`` and ``place_params`` return; stacked with ``scan_layers``).

    Computed once: tracing the Flax init costs more than the Orbax read of
    a small model, and every version load needs it.
    """
    if self._abstract_params is None:
      shapes = self._per_layer_shapes()
      if self.scan_layers:
        shapes = stack_layers(shapes, self.model_cfg.n_layers)
      self._abstract_params = abstract_target_like(shapes, self._program_param_sharding)
    return self._abstract_params

  def _per_layer_shapes(self) -> Params:
    return model_abstract_params(self.model_cfg)  # the shared, cached init trace

  def _snapshot_target(self) -> Params:
    """The per-layer layout snapshots hold, on ``param_sharding``: the restore target."""
    if not self.scan_layers:
      return self.abstract_params()
    if self._snapshot_abstract is None:
      self._snapshot_abstract = abstract_target_like(self._per_layer_shapes(), self.param_sharding)
    return self._snapshot_abstract

  def _program_layout(self, params: Params) -> Params:
    """Per-layer params (on ``param_sharding``) -> what the programs take."""
    if not self.scan_layers:
      return params
    if self._stack_fn is None:
      self._stack_fn = jax.jit(
          functools.partial(stack_layers, n_layers=self.model_cfg.n_layers),
          out_shardings=self._program_param_sharding)
    return self._stack_fn(params)

  def load_params(  # pytype: disable=signature-mismatch
      self, reader: SnapshotReader, version: int, incarnation: str | None = None
  ) -> Params:
    """Restores snapshot ``version`` (of run ``incarnation``) onto this engine's devices."""
    params, _ = reader.load(int(version), target=self._snapshot_target(), incarnation=incarnation)
    return self._program_layout(params)

  def place_params(self, params: Params) -> Params:
    """Copies an in-memory param tree onto the engine's devices, param dtype
    and program layout: a per-layer tree (a checkpoint's, the learner's) or
    one already stacked (another scanned engine's ``load_params``, which the
    embedded servers share)."""
    if self.scan_layers and "layers" in params:
      target, sharding = self.abstract_params(), self._program_param_sharding
    else:
      target, sharding = self._snapshot_target(), self.param_sharding
    placed = jax.device_put(jax.tree.map(lambda x, a: x.astype(a.dtype), params, target), sharding)
    return placed if "layers" in placed else self._program_layout(placed)

  def warmup(self, max_versions: int) -> None:
    """Compiles prefill+insert (every bucket), decode for every length bucket
    (and, with ``max_versions`` > 1, every multi-version pass: row bucket x
    length bucket, whatever the number of versions) and slot freeing ahead
    of time.

    Without it the first step that meets a second (third, ...) live version
    or a resumed request's longer prefill bucket compiles mid-run, stalling
    every slot of the server for seconds. Lowering uses abstract params and
    never executes, so no decode state is consumed.
    """
    params, state = self.abstract_params(), self._abstract_state()
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self.replicated)
    i32 = np.int32(0)
    n = jax.ShapeDtypeStruct((self._num_slots,), jnp.int32)
    counts = jax.ShapeDtypeStruct((self._num_slots,), jnp.uint32)
    for t in self.buckets:
      for u in self.prefill_rows(t):
        tokens = jax.ShapeDtypeStruct((u, t), jnp.int32)
        lengths = jax.ShapeDtypeStruct((u,), jnp.int32)
        self._prefill_batch_fn.lower(params, state, tokens, lengths, n, n, counts, i32, key).compile()
    self.warmup_decode(max_versions)
    self._free_fn.lower(state, i32).compile()

  def _abstract_state(self) -> DecodeState:
    return _with_shardings(jax.eval_shape(self._init_impl, jax.random.PRNGKey(0)),
                           self._state_sharding)

  def warmup_decode(self, max_versions: int) -> None:
    """The decode part of :meth:`warmup`: every length bucket's program and,
    with ``max_versions`` > 1, every multi-version pass shape."""
    params, state, i32 = self.abstract_params(), self._abstract_state(), np.int32(0)
    for bound in self.length_buckets:
      self._single_fn.lower(params, state, i32, bound=bound).compile()
    if int(max_versions) > 1:
      acc = _with_shardings(jax.eval_shape(self._empty_step_acc, state), self._acc_sharding())
      self._empty_acc_fn.lower(state).compile()
      for size in self._row_buckets:
        for bound in self.length_buckets:
          self._pass_fn.lower(params, state, acc, i32, size=size, bound=bound).compile()
      self._finish_fn.lower(state, acc).compile()

  # ------------------------------------------------------------------ prefill
  def _next_prefill_count(self) -> int:
    with self._rng_lock:
      self._prefill_count += 1
      return self._prefill_count

  def _next_prefill_key(self) -> jax.Array:
    return jax.random.fold_in(self._base_key, self._next_prefill_count())

  def _prefill_impl(self, params, tokens, true_length, version, rng):
    t = tokens.shape[0]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    hidden, kv = self.model.apply(
        {"params": params}, tokens[None], positions, method=Transformer.prefill)
    cache = KVCache.from_prefill(kv, self.model_cfg.max_seq_len, self.model_cfg.dtype)
    # Only the last real position's logits are needed: [1, V], not [T, V].
    last = jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, axis=0, keepdims=True)
    logits = head_logits(last, head_weight(self.model_cfg, params))
    tok, logp = sample_tokens(logits, rng, self.temperature, self.top_p, self.suppress_mask)
    return Prefix(
        cache=cache,
        token=tok[0],
        logprob=logp[0],
        true_length=true_length,
        version=version,
    )

  def prefill(
      self,
      *,
      params: Params | MultiVersionParams,
      existing_prefix: Prefix | None = None,
      padded_tokens: jax.Array | np.ndarray,
      true_length: int,
      version: int | None = None,
      rng: jax.Array | None = None,
  ) -> Prefix:
    """KV cache of ``padded_tokens[:true_length]`` plus its first sampled token.

    Args:
      params: A :class:`MultiVersionParams` (its newest version is used, the
        DORA rule for new work) or a plain param tree (then ``version`` names
        it; default 0).
      existing_prefix: Not supported (``None`` only): a prompt prefills from
        position 0. (Appending to a prefix needs attention over its cache
        plus the new tokens, a path no caller uses; JetStream's orchestrator
        passes ``None``.)
      padded_tokens: ``[T]`` int32, right-padded to a bucket length (see
        :meth:`pad_tokens`) so compiles are shared.
      true_length: Number of real tokens in ``padded_tokens``.
      version: Version id for a plain param tree.
      rng: Optional PRNG key for the first token; default: engine counter.
    """
    if isinstance(params, MultiVersionParams):
      version = params.newest if version is None else int(version)
      params = params.params[version]
    version = 0 if version is None else int(version)
    tokens = jnp.asarray(padded_tokens, jnp.int32).reshape(-1)
    if not 0 < true_length <= tokens.shape[0]:
      raise ValueError(f"true_length={true_length} not in (0, {tokens.shape[0]}]")
    if existing_prefix is not None:
      raise NotImplementedError("prefill appends to no existing_prefix: pass the whole context")
    if tokens.shape[0] > self.model_cfg.max_seq_len:
      raise ValueError(
          f"prefix of {tokens.shape[0]} tokens exceeds max_seq_len={self.model_cfg.max_seq_len}")
    rng = self._next_prefill_key() if rng is None else rng
    return self._prefill_fn(params, tokens, jnp.int32(true_length), jnp.int32(version), rng)

  # ------------------------------------------------------- batched prefill
  def prefill_rows(self, length: int) -> tuple[int, ...]:
    """Row buckets of a batched prefill at padded length ``length``.

    Powers of four up to the slots (few compiles: ``warmup`` compiles each
    bucket at every length; a round's distinct contexts are few when GRPO
    groups share prompts, and padded rows cost prefill, not decode), capped
    so one call holds at most ``prefill_batch_tokens`` tokens (a long resumed
    context prefills alone rather than padding a batch of short prompts to
    its length).
    """
    cap = max(1, min(self._num_slots, self._prefill_batch_tokens // max(1, int(length))))
    out, u = [], 1
    while u < cap:
      out.append(u)
      u *= 4
    out.append(cap)
    return tuple(sorted(set(out)))

  def _prefill_batch_impl(self, params, state, tokens, true_lengths, src, slots, counts, version,
                          base_key):
    """Prefills ``U`` distinct contexts once and inserts them into ``N`` slots.

    ``tokens[U,T]`` / ``true_lengths[U]``: the distinct contexts, right-padded.
    ``src[N]``: which context slot ``slots[N]`` receives (a GRPO group's G
    members share one context: its prompt is computed once and its KV
    entries copied G times). Padding entries carry ``slots = num_slots`` and
    are dropped. Each slot samples its own first token with its own key
    (``fold_in(base_key, counts[i])``), so group members diverge from the
    first token and a request's randomness does not depend on what it was
    batched with. Attention runs within each context (no cache read), and
    only the ``T`` written positions of each slot's cache row are touched,
    so prefill costs the prompt, not ``max_seq_len``.
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
    logits = head_logits(last, head_weight(self.model_cfg, params))
    keys = jax.vmap(lambda c: jax.random.fold_in(base_key, c))(counts)
    tok, logp = jax.vmap(
        lambda lg, key: sample_tokens(lg[None], key, self.temperature, self.top_p,
                                      self.suppress_mask))(logits[src], keys)
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

  def prefill_insert_batch_async(
      self, params: Params, version: int, contexts: Sequence[np.ndarray], slots: Sequence[int],
      decode_state: DecodeState,
  ) -> tuple[DecodeState, list[FirstToken], PrefillWork]:
    """Prefills ``contexts[i]`` into ``slots[i]`` (all on ``version``), batched.

    One admission round becomes a few device calls: contexts are grouped by
    padded length bucket, identical contexts (a GRPO group's G members) are
    computed once when ``share_prompt_prefill`` is on, and each call holds up
    to ``prefill_rows`` distinct contexts. Nothing is read back: returns the
    new state (``decode_state`` is donated), ``firsts`` where request ``i``'s
    first ``(token, logprob)`` is row ``firsts[i].row`` of device array
    ``firsts[i].values`` (and, for an MoE model, its context's routes row
    ``firsts[i].context`` of ``firsts[i].routes``, ``[U, T, moe_layers, k]``), and the
    prefill work done (for metrics).
    """
    if len(contexts) != len(slots):
      raise ValueError(f"{len(contexts)} contexts for {len(slots)} slots")
    if len({int(s) for s in slots}) != len(slots):
      raise ValueError(f"slots {list(slots)} repeat")
    ctxs = [np.asarray(c, np.int32).reshape(-1) for c in contexts]
    for slot, c in zip(slots, ctxs):
      if not 0 <= int(slot) < self._num_slots:
        raise ValueError(f"slot {slot} out of range [0, {self._num_slots})")
      if not 0 < len(c) <= self.model_cfg.max_seq_len:
        raise ValueError(f"context of {len(c)} tokens not in (0, {self.model_cfg.max_seq_len}]")
    # Distinct contexts, each with the requests that use it, per length bucket.
    distinct: dict[bytes | int, tuple[np.ndarray, list[int]]] = {}
    for i, c in enumerate(ctxs):
      key = c.tobytes() if self.share_prompt_prefill else i
      distinct.setdefault(key, (c, []))[1].append(i)
    by_bucket: dict[int, list[tuple[np.ndarray, list[int]]]] = {}
    for c, users in distinct.values():
      by_bucket.setdefault(self._bucket(len(c)), []).append((c, users))
    firsts: list[tuple[jax.Array, int] | None] = [None] * len(ctxs)
    work = PrefillWork(requests=len(ctxs), requested_tokens=sum(len(c) for c in ctxs))
    state = decode_state
    for t, entries in sorted(by_bucket.items()):
      cap = self.prefill_rows(t)[-1]
      for lo in range(0, len(entries), cap):
        chunk = entries[lo:lo + cap]
        u = next(r for r in self.prefill_rows(t) if r >= len(chunk))
        tokens = np.full((u, t), self.tokenizer.pad_id, np.int32)
        lengths = np.ones((u,), np.int32)
        src = np.zeros((self._num_slots,), np.int32)
        dst = np.full((self._num_slots,), self._num_slots, np.int32)  # out of range = dropped
        counts = np.zeros((self._num_slots,), np.uint32)
        row = 0
        for j, (c, users) in enumerate(chunk):
          tokens[j, :len(c)] = c
          lengths[j] = len(c)
          for i in users:
            src[row], dst[row], counts[row] = j, int(slots[i]), self._next_prefill_count()
            firsts[i] = row
            row += 1
        state, out = self._prefill_batch_fn(
            params, state, tokens, lengths, src, dst, counts, np.int32(version), self._base_key)
        values, routes = out
        for j, (_, users) in enumerate(chunk):
          for i in users:
            firsts[i] = FirstToken(values, firsts[i], routes, j)
        work.calls += 1
        work.computed_tokens += sum(len(c) for c, _ in chunk)
        work.padded_tokens += u * t
    return state, firsts, work

  def prefill_insert(
      self, params: Params, version: int, padded_tokens: np.ndarray, true_length: int,
      decode_state: DecodeState, slot: int,
  ) -> tuple[DecodeState, int, float]:
    """One request's :meth:`prefill_insert_batch_async`, read back.

    Returns the new state (``decode_state`` is donated) and the first token
    and its log-prob.
    """
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
    if not 0 < true_length <= tokens.shape[0]:
      raise ValueError(f"true_length={true_length} not in (0, {tokens.shape[0]}]")
    state, firsts, _ = self.prefill_insert_batch_async(
        params, version, [tokens[:true_length]], [slot], decode_state)
    tok, lp = np.asarray(firsts[0].values)[firsts[0].row]
    return state, int(tok), float(lp)

  def _bucket(self, n: int) -> int:
    b = _smallest_holding(self.buckets, n)
    if b is None:
      raise ValueError(f"{n} tokens exceed max_seq_len={self.model_cfg.max_seq_len}")
    return b

  def pad_tokens(self, tokens: np.ndarray) -> tuple[np.ndarray, int]:
    """Right-pads ``tokens`` with PAD to the smallest bucket that fits."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    n = int(tokens.shape[0])
    return np.pad(tokens, (0, self._bucket(n) - n), constant_values=self.tokenizer.pad_id), n

  # ------------------------------------------------------------------- insert
  def _insert_impl(self, prefix: Prefix, state: DecodeState, slot):
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

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Puts ``prefix`` into ``slot`` (pinning the slot to the prefix's version).

    ``decode_state`` is donated: use only the returned state afterwards.
    """
    if not 0 <= slot < self._num_slots:
      raise ValueError(f"slot {slot} out of range [0, {self._num_slots})")
    return self._insert_fn(prefix, decode_state, jnp.int32(slot))

  # ----------------------------------------------------------------- generate
  # A decode step's accumulators: the new k/v entries ``[L,B,1,H,D]``, the
  # sampled tokens and log-probs ``[B]``, which rows some pass owned, and
  # whether the host's hint was violated. Passes only read ``state.cache``;
  # the step commits every owned row's entry once, in place
  # (``KVCache.write_step``), so a pass costs its rows' compute and never a
  # copy of the cache.
  def _empty_step_acc(self, state: DecodeState):
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

  def _decode_version_impl(self, params, state: DecodeState, acc, version, bound: int):
    """One decode pass of ``version`` over every slot; keeps the rows pinned to it.

    Rows of other versions run too (a full pass is cheaper than gathering
    when ``version`` holds most slots) and are discarded.
    """
    acc_new, acc_tokens, acc_logp, owned, bad, acc_routes = acc
    (logits, new), routes = self._decode_apply(
        params, state.tokens[:, None], state.positions[:, None], state.cache, None, bound)
    tok, logp = sample_tokens(logits[:, 0], self._version_key(state, version), self.temperature,
                              self.top_p, self.suppress_mask)
    mine = state.active & (state.version == version)
    sel = mine[None, :, None, None, None]
    acc_new = KVCache(k=jnp.where(sel, new.k, acc_new.k), v=jnp.where(sel, new.v, acc_new.v))
    bad = bad | jnp.any(mine & (state.positions > bound))
    if routes is not None:
      acc_routes = jnp.where(mine[:, None, None], routes, acc_routes)
    return (acc_new, jnp.where(mine, tok, acc_tokens), jnp.where(mine, logp, acc_logp),
            owned | mine, bad, acc_routes)

  def _decode_rows_impl(self, params, state: DecodeState, acc, version, size: int, bound: int):
    """Like :meth:`_decode_version_impl`, but computes only the (at most
    ``size``) rows pinned to ``version``, gathered into a smaller batch.

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
    tok, logp = sample_tokens(logits[:, 0], self._version_key(state, version), self.temperature,
                              self.top_p, self.suppress_mask)
    acc_new = KVCache(
        k=acc_new.k.at[:, idx].set(new.k, mode="drop"),
        v=acc_new.v.at[:, idx].set(new.v, mode="drop"),
    )
    bad = bad | (jnp.sum(mine) > size) | jnp.any(mine & (state.positions > bound))
    if routes is not None:
      acc_routes = acc_routes.at[idx].set(routes, mode="drop")
    return (acc_new, acc_tokens.at[idx].set(tok, mode="drop"),
            acc_logp.at[idx].set(logp, mode="drop"), owned | mine, bad, acc_routes)

  def _decode_pass_impl(self, params, state: DecodeState, acc, version, *, size: int, bound: int):
    """One version's pass of a multi-version step (``size`` rows; all = full pass)."""
    if size >= self._num_slots:
      return self._decode_version_impl(params, state, acc, version, bound)
    return self._decode_rows_impl(params, state, acc, version, size, bound)

  def _finish_step_impl(self, state: DecodeState, acc):
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
    new_state = state.replace(
        cache=cache, tokens=tokens, positions=positions, lengths=lengths,
        rng=jax.random.split(state.rng)[1])
    data = jnp.stack([tokens, active.astype(jnp.int32), lengths], axis=1)
    return new_state, data, logp[:, None], bad, routes

  def _single_version_step_impl(self, params, state: DecodeState, version, *, bound: int):
    """The common one-live-version case: one pass, one in-place commit."""
    acc = self._decode_version_impl(params, state, self._empty_step_acc(state), version, bound)
    return self._finish_step_impl(state, acc)

  def _length_bucket(self, max_position: int) -> int:
    # Positions never pass max_seq_len, the last bucket.
    return _smallest_holding(self.length_buckets, max_position) or self.length_buckets[-1]

  def _row_bucket(self, rows: int) -> int:
    return _smallest_holding(self._row_buckets, rows) or self._num_slots

  def decode_hint(self, decode_state: DecodeState, live: Sequence[int] = ()) -> DecodeHint:
    """The exact hint for ``decode_state``, read from the device (a sync:
    the driver tracks the same facts on the host instead)."""
    positions, active, version = jax.device_get(
        (decode_state.positions, decode_state.active, decode_state.version))
    pos = positions[active]
    rows = {int(v): int(np.sum(active & (version == v))) for v in live or np.unique(version[active])}
    return DecodeHint(int(pos.max()) if pos.size else 0, rows)

  def generate(
      self, params: MultiVersionParams | Params, decode_state: DecodeState,
      hint: DecodeHint | None = None,
  ) -> tuple[DecodeState, DoraResultTokens]:
    """Advances every active slot by one token under its pinned version.

    Args:
      params: :class:`MultiVersionParams`; versions in ``live`` are run (if
        ``live`` is empty, every version in ``params``). A plain param tree is
        treated as version 0.
      decode_state: Donated.
      hint: Host-side bounds that pick the static program (see
        :class:`DecodeHint`); ``None`` reads them from ``decode_state``,
        which waits for the device. A wrong hint is reported in the result's
        ``hint_violated``, never silently used.

    Returns:
      The new state and a ``[B, 3]`` (token, valid, length) result with
      per-token log-probs. Rows pinned to a version not run this step keep
      their state and report ``valid``=active but a stale token; the driver
      only runs with all pinned versions live.
    """
    if not isinstance(params, MultiVersionParams):
      params = MultiVersionParams.single(0, params)
    live = params.live or tuple(sorted(params.params))
    if hint is None:
      hint = self.decode_hint(decode_state, live)
    bound = self._length_bucket(int(hint.max_position))
    if len(live) == 1:
      v = live[0]
      out = self._single_fn(params.params[v], decode_state, np.int32(v), bound=bound)
    else:
      out = self._multi_version_step(params, live, decode_state, hint, bound)
    new_state, data, logp, bad, routes = out
    return new_state, self._result(data, logp, bad, routes)

  def _multi_version_step(self, params: MultiVersionParams, live: Sequence[int],
                          state: DecodeState, hint: DecodeHint, bound: int):
    """One pass per live version over that version's rows; one commit.

    Each version decodes only its own rows, gathered into the smallest of
    ``row_buckets`` that holds the host's count (a full pass when it holds
    more than half the slots), so K live versions cost about one pass over
    the slots rather than K, and every program is static.
    """
    acc = self._empty_acc_fn(state)
    for v in live:
      size = self._row_bucket(int(hint.version_rows.get(v, self._num_slots)))
      acc = self._pass_fn(params.params[v], state, acc, np.int32(v), size=size, bound=bound)
    return self._finish_fn(state, acc)

  @staticmethod
  def _result(data: jax.Array, logp: jax.Array, bad: jax.Array,
              routes: jax.Array | None) -> DoraResultTokens:
    return DoraResultTokens(
        data=data,
        tokens_idx=(0, 1),
        valid_idx=(1, 2),
        length_idx=(2, 3),
        samples_per_slot=1,
        logprobs=logp,
        hint_violated=bad,
        routes=routes,
    )

  # ------------------------------------------------------------- decode state
  def _init_impl(self, rng):
    b = self._num_slots
    return DecodeState(
        cache=KVCache.zeros(self.model_cfg, b),
        tokens=jnp.zeros((b,), jnp.int32),
        positions=jnp.zeros((b,), jnp.int32),
        lengths=jnp.zeros((b,), jnp.int32),
        version=jnp.full((b,), -1, jnp.int32),
        active=jnp.zeros((b,), bool),
        rng=rng,
    )

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    """Empty slots (all inactive, unpinned) on the engine mesh."""
    del args, kwargs
    # Prefill keys use fold_in(base, n >= 1), so 0 is free for the decode rng.
    return self._init_fn(jax.random.fold_in(self._base_key, 0))

  def _free_impl(self, state: DecodeState, slot):
    return state.replace(
        active=state.active.at[slot].set(False), version=state.version.at[slot].set(-1)
    )

  def free_slot(self, decode_state: DecodeState, slot: int) -> DecodeState:
    """Marks ``slot`` empty so it stops computing and is pinned to nothing.

    Optional (a finished slot may simply be overwritten by the next
    ``insert``); ``decode_state`` is donated.
    """
    return self._free_fn(decode_state, jnp.int32(slot))

  # ------------------------------------------------------- engine_api members
  def get_prefix_destination_sharding(self) -> Any:
    return self._prefix_sharding()

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    # The HF tokenizer's directory, or a name for the in-repo character map.
    return tokenizer_pb2.TokenizerParameters(
        path=getattr(self.tokenizer, "path", "jax_dora:CharTokenizer"))

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> PolicyTokenizer:
    del metadata
    return self.tokenizer

  @property
  def max_concurrent_decodes(self) -> int:
    return self._num_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill_length

  @property
  def max_seq_len(self) -> int:
    return self.model_cfg.max_seq_len

  @property
  def mesh(self) -> Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None


def build_engine(
    config, devices: Sequence[jax.Device], seed: int | None = None, policy: Any = None
) -> DoraEngine:
  """Engine from the run config's ``model`` and ``rollout`` blocks.

  ``policy``: a resolved :class:`jax_dora.policy.PolicySpec` (model config
  and tokenizer); resolved from ``config`` when not given.
  """
  from jax_dora.config import RunConfig  # pylint: disable=g-import-not-at-top
  from jax_dora.csv_fields import split_csv  # pylint: disable=g-import-not-at-top

  if policy is None:
    from jax_dora.policy import resolve_policy  # pylint: disable=g-import-not-at-top

    policy = resolve_policy(config)
  config = RunConfig.of(config)
  r = config.rollout
  model_cfg = policy.model_cfg
  if r.param_dtype and r.param_dtype != model_cfg.param_dtype:
    # Servers may hold the policy narrower than the learner's master copy
    # (bf16 inference weights); snapshots are cast as they are restored.
    model_cfg = dataclasses.replace(model_cfg, param_dtype=r.param_dtype)
  return DoraEngine(
      model_cfg,
      policy.tokenizer,
      num_slots=r.slots,
      max_prefill_length=r.max_prefill_length,
      devices=devices,
      temperature=r.temperature,
      top_p=r.top_p,
      seed=config.seed if seed is None else seed,
      tensor_parallel=r.tensor_parallel,
      decode_attention=r.decode_attention,
      attention_block=r.attention_block,
      prefill_batch_tokens=r.prefill_batch_tokens,
      share_prompt_prefill=r.share_prompt_prefill,
      length_buckets=split_csv(r.decode_length_buckets, int),
      scan_layers=r.scan_layers,
  )
