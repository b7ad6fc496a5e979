"""JetStream ``Engine`` for the jax-dora Transformer, with multi-version decode: the facade.

The engine is the accelerator half of a rollout server (JetStream's split):
``prefill`` computes one prompt's KV cache and first token, ``insert`` copies it
into a free decode slot, ``generate`` advances every slot by one token. Two
things differ from a stock JetStream engine:

* **Multi-version decode.** ``generate`` takes a :class:`MultiVersionParams`
  (several policy versions at once). Every slot is *pinned* to the version that
  prefilled it; one decode pass is run per live version and each slot commits
  only the pass of its own version. A trajectory therefore never mixes
  versions within a span by construction, while a single server can keep old
  trajectories running after a new policy arrives (DORA).
* **Log-probs.** :class:`DoraResultTokens` carries the behaviour log-prob of
  every sampled token, which the learner needs for importance ratios; for an
  MoE policy it also carries the experts each fed token was routed to.

:class:`DoraEngine` only composes the parts, each in a module of its own
(DESIGN.md, "The rollout server"):

* placement (``placement.py``): mesh, shardings, parameter layout, snapshot restore;
* the compiled programs and their buckets (``programs.py``, ``buckets.py``), over
  the device computations (``device_steps.py``);
* prefill planning (``prefill_plan.py``, host-side numpy): shared prompts, batch layout;
* and here, the JetStream ``Engine``/``Tokenizer`` surface and argument checks
  (single-prompt ``prefill`` runs the batched prefill into a one-slot state:
  one prefill implementation).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_dora.jetstream_api import engine_api, tokenizer_pb2
from jax_dora.model import DECODE_ATTENTION, KVCache, ModelConfig, Transformer, suppress_mask
from jax_dora.model.tokenizer import PolicyTokenizer
from jax_dora.rollout.buckets import ProgramBuckets, decode_length_buckets, prefill_buckets
from jax_dora.rollout.device_steps import DeviceSteps
from jax_dora.rollout.engine_types import (
    DecodeHint,
    DecodeState,
    DoraResultTokens,
    FirstToken,
    MultiVersionParams,
    Params,
    Prefix,
    PrefillWork,
    decode_result,
)
from jax_dora.rollout.placement import EnginePlacement
from jax_dora.rollout.prefill_plan import plan_extend, plan_prefill
from jax_dora.rollout.programs import EnginePrograms
from jax_dora.snapshots import SnapshotReader

__all__ = ["DecodeHint", "DecodeState", "DoraEngine", "DoraResultTokens", "FirstToken",
           "MultiVersionParams", "Params", "Prefix", "PrefillWork", "build_engine",
           "decode_length_buckets", "prefill_buckets"]


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
          f"max_prefill_length={max_prefill_length} > max_seq_len={model_cfg.max_seq_len}")
    if decode_attention not in DECODE_ATTENTION:
      raise ValueError(f"decode_attention={decode_attention!r} is not one of {DECODE_ATTENTION}")
    if attention_block < 0 or prefill_batch_tokens < 1:
      raise ValueError(f"attention_block={attention_block} must be >= 0 and prefill_batch_tokens="
                       f"{prefill_batch_tokens} >= 1")
    self.model_cfg = model_cfg
    self.tokenizer = tokenizer
    self.decode_attention = decode_attention
    self.share_prompt_prefill = bool(share_prompt_prefill)
    self.temperature = float(temperature)
    self.top_p = float(top_p)
    self._num_slots = int(num_slots)
    self._max_prefill_length = int(max_prefill_length)
    # scan_layers: prefill and decode programs loop over one compiled block
    # (DESIGN.md, Scanning over layers); snapshots keep the per-layer layout.
    self.scan_layers = bool(scan_layers)
    self.placement = EnginePlacement(model_cfg, list(devices) if devices else jax.devices()[:1],
                                     self._num_slots, tensor_parallel, self.scan_layers)
    self.buckets = ProgramBuckets.build(
        num_slots=self._num_slots, max_prefill_length=self._max_prefill_length,
        max_seq_len=model_cfg.max_seq_len, prefill_batch_tokens=prefill_batch_tokens,
        length_buckets=length_buckets, dense_decode=decode_attention == "dense")
    model = Transformer(model_cfg, decode_attention=decode_attention,
                        attention_block=int(attention_block), scan_layers=self.scan_layers)
    steps = DeviceSteps(model_cfg, model, temperature=temperature, top_p=top_p,
                        suppress_mask=suppress_mask(
                            model_cfg.vocab_size, tokenizer.suppressed_ids(model_cfg.vocab_size)))
    self.routing_shape = steps.routing_shape
    self.programs = EnginePrograms(steps, self.placement, self.buckets)
    # First tokens draw from fold_in(base_key, n) with a host-side counter n >= 1
    # (JetStream's prefill has no rng argument; a lock keeps the counter
    # consistent across threads); the decode rng is fold_in(base_key, 0). The
    # key lives on the server's devices, not the default (the learner's).
    self._base_key = jax.device_put(jax.random.PRNGKey(seed), self.placement.replicated)
    self._prefill_count = 0
    self._rng_lock = threading.Lock()

  # ----------------------------------------------------------------- layout
  @property
  def param_sharding(self) -> Params:
    """Shardings of the per-layer parameter layout (snapshots, checkpoints)."""
    return self.placement.param_sharding

  @property
  def length_buckets(self) -> tuple[int, ...]:
    """Static attention bounds of decode steps (``ProgramBuckets.decode_lengths``)."""
    return self.buckets.decode_lengths

  def abstract_params(self) -> Params:
    return self.placement.abstract_params()

  def load_params(  # pytype: disable=signature-mismatch
      self, reader: SnapshotReader, version: int, incarnation: str | None = None) -> Params:
    """Restores snapshot ``version`` (of run ``incarnation``) onto this engine's devices."""
    return self.placement.load_params(reader, version, incarnation)

  def place_params(self, params: Params) -> Params:
    """Copies an in-memory param tree onto the engine's devices, dtype and program layout."""
    return self.placement.place_params(params)

  def warmup(self, max_versions: int) -> None:
    """Compiles every program ahead of time (``EnginePrograms.warmup``)."""
    self.programs.warmup(max_versions)

  def warmup_decode(self, max_versions: int) -> None:
    self.programs.warmup_decode(max_versions)
  # ---------------------------------------------------------------- prefill
  def _next_prefill_count(self) -> int:
    with self._rng_lock:
      self._prefill_count += 1
      return self._prefill_count

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

    Runs the batched prefill program (one context, one slot of its own).

    Args:
      params: A :class:`MultiVersionParams` (its newest version is used, the
        DORA rule for new work) or a plain param tree (then ``version`` names
        it; default 0).
      existing_prefix: Not supported (``None`` only): a prompt prefills from
        position 0 (JetStream's orchestrator passes ``None``).
      padded_tokens: ``[T]`` int32, right-padded to a bucket length (see
        :meth:`pad_tokens`) so compiles are shared.
      true_length: Number of real tokens in ``padded_tokens``.
      version: Version id for a plain param tree.
      rng: Not supported (``None`` only): first tokens draw from the engine's
        per-request counter, as in the driver's admission rounds.
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
    if rng is not None:
      raise NotImplementedError("prefill draws its first token from the engine's counter")
    if tokens.shape[0] > self.model_cfg.max_seq_len:
      raise ValueError(
          f"prefix of {tokens.shape[0]} tokens exceeds max_seq_len={self.model_cfg.max_seq_len}")
    return self.programs.prefill_prefix(params, tokens, true_length, version,
                                        self._next_prefill_count(), self._base_key)

  def prefill_insert_batch_async(
      self, params: Params, version: int, contexts: Sequence[np.ndarray], slots: Sequence[int],
      decode_state: DecodeState,
  ) -> tuple[DecodeState, list[FirstToken], PrefillWork]:
    """Prefills ``contexts[i]`` into ``slots[i]`` (all on ``version``), batched.

    One admission round becomes a few device calls (``prefill_plan``): identical
    contexts (a GRPO group's G members) are computed once when
    ``share_prompt_prefill`` is on. Nothing is read back: returns the new
    state (``decode_state`` is donated), ``firsts`` where request ``i``'s
    first ``(token, logprob)`` is row ``firsts[i].row`` of device array
    ``firsts[i].values`` (and, for an MoE model, its context's routes row
    ``firsts[i].context`` of ``firsts[i].routes``), and the prefill work done.
    """
    calls, work = plan_prefill(contexts, slots, self.buckets, pad_id=self.tokenizer.pad_id,
                               share_prompts=self.share_prompt_prefill,
                               next_count=self._next_prefill_count)
    firsts: list[FirstToken | None] = [None] * len(contexts)
    state = decode_state
    for call in calls:
      state, (values, routes) = self.programs.prefill(params, state, call, version, self._base_key)
      for i, row, context in call.users:
        firsts[i] = FirstToken(values, row, routes, context)
    return state, firsts, work

  # ------------------------------------------------- held KV (multi-turn)
  def init_held_pool(self, rows: int) -> KVCache:
    """The held-KV pool of ``rows`` cache rows (``rollout/held_kv.py``)."""
    return self.programs.init_pool(rows)

  def warmup_held(self, rows: int) -> None:
    self.programs.warmup_held(rows)

  @property
  def longest_extend(self) -> int:
    """The most new tokens one held-context resume takes (longer: a full re-prefill)."""
    return self.programs.extend_lengths()[-1]

  def park(self, decode_state: DecodeState, pool: KVCache, slot: int, pool_row: int,
           n_tokens: int) -> KVCache:
    """Copies ``slot``'s first ``n_tokens`` cache entries into ``pool_row`` (``pool`` donated;
    ``decode_state`` only read, before anything can overwrite the slot)."""
    length = self.buckets.decode_length(max(1, int(n_tokens)))
    return self.programs.park(decode_state, pool, slot, pool_row, length)

  def extend_insert_batch_async(
      self, params: Params, version: int, chunks: Sequence[np.ndarray], starts: Sequence[int],
      pool_rows: Sequence[int], slots: Sequence[int], decode_state: DecodeState, pool: KVCache,
  ) -> tuple[DecodeState, list[FirstToken], PrefillWork]:
    """Resumes held contexts: slot ``slots[i]`` gets pool row ``pool_rows[i]``'s first
    ``starts[i]`` entries and prefills only ``chunks[i]`` after them (all on ``version``,
    the version that computed those entries). As :meth:`prefill_insert_batch_async`
    otherwise: nothing is read back, ``decode_state`` is donated."""
    calls, work = plan_extend(chunks, starts, pool_rows, slots, self.buckets,
                              self.programs.extend_lengths(), pad_id=self.tokenizer.pad_id,
                              next_count=self._next_prefill_count)
    firsts: list[FirstToken | None] = [None] * len(chunks)
    state = decode_state
    for call in calls:
      state, (values, routes) = self.programs.extend(params, state, pool, call, version,
                                                     self._base_key)
      for i, row in call.users:
        firsts[i] = FirstToken(values, row, routes, row, offset=int(starts[i]))
    return state, firsts, work

  def prefill_insert(
      self, params: Params, version: int, padded_tokens: np.ndarray, true_length: int,
      decode_state: DecodeState, slot: int,
  ) -> tuple[DecodeState, int, float]:
    """One request's :meth:`prefill_insert_batch_async`, read back: the new state
    (``decode_state`` is donated), the first token and its log-prob."""
    tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
    if not 0 < true_length <= tokens.shape[0]:
      raise ValueError(f"true_length={true_length} not in (0, {tokens.shape[0]}]")
    state, firsts, _ = self.prefill_insert_batch_async(
        params, version, [tokens[:true_length]], [slot], decode_state)
    tok, lp = np.asarray(firsts[0].values)[firsts[0].row]
    return state, int(tok), float(lp)

  def pad_tokens(self, tokens: np.ndarray) -> tuple[np.ndarray, int]:
    """Right-pads ``tokens`` with PAD to the smallest prefill bucket that fits."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    n = int(tokens.shape[0])
    return np.pad(tokens, (0, self.buckets.prefill_length(n) - n),
                  constant_values=self.tokenizer.pad_id), n

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """Puts ``prefix`` into ``slot`` (pinning the slot to the prefix's version).

    ``decode_state`` is donated: use only the returned state afterwards.
    """
    if not 0 <= slot < self._num_slots:
      raise ValueError(f"slot {slot} out of range [0, {self._num_slots})")
    return self.programs.insert(prefix, decode_state, slot)

  # ----------------------------------------------------------------- decode
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
    new_state, data, logp, bad, routes = self.programs.decode(params, live, decode_state, hint)
    return new_state, decode_result(data, logp, bad, routes)

  # ------------------------------------------------------------ decode state
  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    """Empty slots (all inactive, unpinned) on the engine mesh."""
    del args, kwargs
    return self.programs.init_state(jax.random.fold_in(self._base_key, 0))

  def free_slot(self, decode_state: DecodeState, slot: int) -> DecodeState:
    """Marks ``slot`` empty so it stops computing and is pinned to nothing.

    Optional (a finished slot may simply be overwritten by the next
    ``insert``); ``decode_state`` is donated.
    """
    return self.programs.free(decode_state, slot)

  # ------------------------------------------------------- engine_api members
  def get_prefix_destination_sharding(self) -> Any:
    return self.placement.prefix

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
    return self.placement.mesh

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
