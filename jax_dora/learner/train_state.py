"""Sharded learner state and the jitted policy-gradient train step.

Parameters and optimizer state are laid out on the learner mesh from the
model's logical axis names (MaxText style): the boxed abstract state gives a
PartitionSpec per leaf, ``LOGICAL_AXIS_RULES`` maps it to mesh axes, and the
init and train step are jitted with those shardings so nothing is ever
materialised unsharded on one device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dora.config.learner import LearnerConfig
from jax_dora.learner.batching import parse_buckets
from jax_dora.learner.length_groups import plan_micro_batches, take_micro_batch
from jax_dora.learner.router_losses import router_losses, router_stats
from jax_dora.learner.losses import (
  BatchTotals,
  LossSettings,
  loglinear_proximal,
  policy_loss,
)
from jax_dora.learner.mesh import BATCH_AXES, logical_axis_rules
from jax_dora.model import routing
from jax_dora.model.param_copy import cast_copy
from jax_dora.model import (
  ModelConfig,
  Transformer,
  abstract_boxed_params,
  boxed_init,
  chunked_token_logprobs,
  head_weight,
  init_key,
)
from jax_dora.types import no_route


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  ref_params: Any = None


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
  """AdamW with linear warmup, then constant (RL) or cosine decay (SFT), and gradient clipping."""
  warmup = max(cfg.warmup_steps, 1)
  schedule = optax.join_schedules(
      [
          # Start at lr / warmup, not 0, so the very first update moves the policy.
          optax.linear_schedule(cfg.learning_rate / warmup, cfg.learning_rate, warmup),
          (optax.cosine_decay_schedule(cfg.learning_rate, cfg.lr_decay_steps,
                                       alpha=cfg.lr_final_fraction)
           if cfg.lr_decay_steps > 0 else optax.constant_schedule(cfg.learning_rate)),
      ],
      [warmup],
  )
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=cfg.weight_decay),
  )


def routing_spec(model_cfg: ModelConfig) -> tuple[tuple[int, int], np.dtype] | None:
  """An MoE policy's recorded-routing ``((moe_layers, k), dtype)`` (None: dense)."""
  shape = routing.routing_shape(model_cfg)
  return None if shape is None else (shape, routing.routing_dtype(model_cfg.num_experts))


def batch_shapes(batch_rows: int, seq_len: int,
                 routes: tuple[tuple[int, int], np.dtype] | None = None
                 ) -> dict[str, tuple[tuple[int, ...], Any]]:
  """``name -> (shape, dtype)`` of a train batch (``learner.batching.make_batch``);
  ``routes``: an MoE policy's :func:`routing_spec`."""
  t = int(seq_len) - 1
  out = {
      "inputs": ((batch_rows, t), np.int32),
      "targets": ((batch_rows, t), np.int32),
      "positions": ((batch_rows, t), np.int32),
      "mask": ((batch_rows, t), np.float32),
      "behaviour_logprobs": ((batch_rows, t), np.float32),
      "advantages": ((batch_rows,), np.float32),
      # Learner version minus the version that sampled each target token.
      "token_staleness": ((batch_rows, t), np.float32),
  }
  if routes is not None:
    out["routing"] = ((batch_rows, t) + tuple(routes[0]), routes[1])
  return out


class TrainingDivergedError(RuntimeError):
  """A train step produced a NaN/inf loss, gradient norm or other metric."""


class Learner:
  """Owns the sharded train state on ``mesh`` and runs policy-gradient updates.

  The objective, importance-sampling correction and loss aggregation are
  chosen by name (``jax_dora.learner.losses``). One learner step trains one
  batch and produces one policy version; ``learner.ppo_minibatches > 1``
  splits it into that many optimizer updates (PPO epochs of one pass), with
  the proximal log-probs computed once, before the first update, from the
  parameters of the current version.

  Memory: log-probs come from the hidden states in chunks of
  ``learner.logprob_chunk_size`` positions (never the full ``[B, T, V]``
  logits), the batch can be split into ``learner.micro_batch_size`` rows with
  gradients accumulated in a ``lax.scan``, and ``learner.remat`` chooses
  what each block keeps for the backward pass. With
  ``learner.group_micro_batches_by_length`` the micro-batches are cut from the
  rows sorted by length, each padded to its own bucket, and run as one jitted
  call each (``length_groups``): the same update, without every row paying
  for the batch's longest answer. Optimizer moments (Adam's mu
  and nu) take the dtype of the params they belong to: ``model.param_dtype``.

  Args:
    model_cfg: The policy's architecture.
    learner_cfg: The run config's ``learner`` block.
    mesh: The learner mesh.
    temperature: Sampling temperature of the rollout (log-probs must be of
      the same distribution).
    seed: Random init seed (native models; drawn from ``jax_dora.model.init_key``).
    suppress_mask: ``[vocab]`` ids the sampler never produces
      (``jax_dora.model.suppress_mask``); masked here too so on-policy ratios
      are exactly 1.
    load_params: ``shardings -> params``: initial params placed directly on
      the learner's param shardings (an imported checkpoint); default random
      init.
  """

  def __init__(
      self,
      model_cfg: ModelConfig,
      learner_cfg: LearnerConfig | ml_collections.ConfigDict,
      mesh: Mesh,
      *,
      temperature: float = 1.0,
      seed: int = 0,
      suppress_mask: np.ndarray | None = None,
      load_params: Callable[[Any], Any] | None = None,
  ):
    if not temperature > 0:
      raise ValueError(f"temperature must be > 0 (the learner divides logits by it), got {temperature}")
    cfg = LearnerConfig.of(learner_cfg)  # checked and typed once, here
    self.model_cfg = model_cfg
    self.cfg = cfg
    self.mesh = mesh
    self.temperature = float(temperature)
    self.suppress_mask = suppress_mask
    self.logprob_chunk = cfg.logprob_chunk_size
    self.micro_batch = cfg.micro_batch_size
    # MoE: batches carry the rollout's recorded routes (``routing``); with
    # moe_routing=replay the forward routes by them.
    self.routing = routing_spec(model_cfg)
    self.model = Transformer(model_cfg, remat=cfg.remat,
                             replay_routing=cfg.moe_routing == "replay")
    self.tx = make_optimizer(cfg)
    self.use_ref = cfg.kl_coef > 0.0
    self.loss_settings = LossSettings.from_config(cfg, default_norm_length=model_cfg.max_seq_len)
    # -1: the checkpoint's own coefficient (ModelConfig.router_aux_loss_coef).
    self.moe_aux_loss_coef = (model_cfg.router_aux_loss_coef if cfg.moe_aux_loss_coef < 0
                              else cfg.moe_aux_loss_coef)
    self.ppo_minibatches = cfg.ppo_minibatches
    self.group_by_length = cfg.group_micro_batches_by_length
    if self.group_by_length and self.micro_batch <= 0:
      raise ValueError("learner.group_micro_batches_by_length needs learner.micro_batch_size > 0")
    batch_devices = math.prod(mesh.shape[a] for a in BATCH_AXES)
    if self.group_by_length and self.micro_batch % batch_devices:
      raise ValueError(f"learner.micro_batch_size={self.micro_batch} must be a multiple of the"
                       f" {batch_devices} data x fsdp x expert devices the rows are sharded over")
    self.seq_len_buckets = parse_buckets(cfg.seq_len_buckets, model_cfg.max_seq_len)

    # The state's layout comes from the abstract params (the model's init
    # traced once per process, shared with the rollout side) through the
    # optimizer's init: no second trace of the model.
    abstract = jax.eval_shape(self._boxed_state, abstract_boxed_params(model_cfg))
    specs = nn.get_partition_spec(abstract)
    rules = logical_axis_rules(model_cfg.n_kv_heads, mesh.shape.get("tensor", 1))
    with nn.logical_axis_rules(rules):
      self.state_sharding = nn.logical_to_mesh_sharding(specs, mesh, rules)
    self.batch_axes = BATCH_AXES
    self.batch_sharding = NamedSharding(mesh, P(self.batch_axes))
    self.replicated = NamedSharding(mesh, P())
    if load_params is None:
      # One program seeds the key, draws every param and zeroes the optimizer
      # state straight into their shardings (nothing op by op, nothing unsharded).
      init = jax.jit(self._random_state, out_shardings=self.state_sharding)
      self.state: TrainState = init(seed)
    else:
      params = load_params(self.state_sharding.params)
      # Donated: the state's params are the loaded buffers, not a copy of them.
      self.state = jax.jit(self._state_from_params, out_shardings=self.state_sharding,
                           donate_argnums=(0,))(params)
    self._step_fn = jax.jit(
        self._train_step,
        in_shardings=(self.state_sharding, self.batch_sharding),
        out_shardings=(self.state_sharding, self.replicated),
        donate_argnums=(0,),
    )
    # The length-grouped step: one call per micro-batch, then one update.
    params_sharding = self.state_sharding.params
    ref_sharding = self.state_sharding.ref_params
    self._micro_grads_fn = jax.jit(
        self._micro_gradients,
        in_shardings=(params_sharding, self.batch_sharding, ref_sharding, self.replicated),
        out_shardings=(self.replicated, self.replicated, params_sharding))
    self._micro_accumulate_fn = jax.jit(
        self._micro_accumulate,
        in_shardings=(params_sharding, self.batch_sharding, ref_sharding, self.replicated,
                      (self.replicated, params_sharding)),
        out_shardings=((self.replicated, params_sharding), self.replicated),
        donate_argnums=(4,))
    self._apply_fn = jax.jit(
        self._apply_gradients, static_argnums=(2,),
        in_shardings=(self.state_sharding, params_sharding),
        out_shardings=(self.state_sharding, self.replicated),
        donate_argnums=(0,))
    self._logprobs_fn = jax.jit(
        self._trained_logprobs, in_shardings=(params_sharding, self.batch_sharding),
        out_shardings=self.batch_sharding)

  # -- construction ---------------------------------------------------------
  def _boxed_state(self, params: Any) -> TrainState:
    """The state around ``params`` with their ``nn.Partitioned`` boxes kept, for the
    logical axis names of every leaf (Adam's moments inherit their param's)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=self.tx.init(params),
        ref_params=params if self.use_ref else None,
    )

  def _random_state(self, seed: jax.Array) -> TrainState:
    # ``boxed_init`` is jitted and shared: its trace is cached, so this traces
    # only the seeding, the unboxing and the optimizer's zeros.
    params = boxed_init(self.model_cfg)(init_key(seed))
    return self._state_from_params(nn.meta.unbox(params))

  def _state_from_params(self, params: Any) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=self.tx.init(params),
        # A distinct buffer: the train step donates ``params``.
        ref_params=jax.tree.map(jnp.copy, params) if self.use_ref else None,
    )

  # -- training -------------------------------------------------------------
  def _token_logprobs(self, params, batch) -> jax.Array:
    return self._token_logprobs_and_router(params, batch, router=False)[0]

  def _token_logprobs_and_router(self, params, batch, router: bool = True
                                 ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """Target log-probs and, for an MoE policy (``router``), its router statistics.

    The router counts a row's real tokens: its inputs up to its last trained
    target (rows are right-padded; a row with nothing trained adds nothing).
    """
    moe = router and self.model_cfg.num_experts > 0
    if moe:
      real = jnp.flip(jnp.cumsum(jnp.flip(batch["mask"], -1), -1), -1) > 0
      hidden, inter = self.model.apply(
          {"params": params}, batch["inputs"], batch["positions"], return_hidden=True,
          token_mask=real, routing=batch.get("routing"), mutable=["intermediates"])
    else:
      hidden = self.model.apply(
          {"params": params}, batch["inputs"], batch["positions"], return_hidden=True,
          routing=batch.get("routing"))
    logp = chunked_token_logprobs(
        hidden, head_weight(self.model_cfg, params), batch["targets"],
        temperature=self.temperature, mask=self.suppress_mask, chunk=self.logprob_chunk,
        softcap=self.model_cfg.final_logit_softcap)
    return logp, (router_stats(inter) if moe else None)

  @staticmethod
  def _only_trained(batch, logp: jax.Array) -> jax.Array:
    """``logp`` where the mask is set, 0 elsewhere.

    Padded targets may be suppressed ids (-1e30): keep them out of exp().
    """
    return jnp.where(batch["mask"] > 0, logp, 0.0)

  def _trained_logprobs(self, params, batch) -> jax.Array:
    """Log-probs of the target tokens, 0 where the mask is 0."""
    return self._only_trained(batch, self._token_logprobs(params, batch))

  def _loss(self, params, batch, ref_params, totals: BatchTotals):
    logp, stats = self._token_logprobs_and_router(params, batch)
    logp = self._only_trained(batch, logp)
    ref_logp = None
    if ref_params is not None:
      ref_logp = jax.lax.stop_gradient(self._trained_logprobs(ref_params, batch))
    settings = self.loss_settings
    prox = batch.get("proximal_logprobs")
    if prox is None and settings.needs_proximal and settings.proximal == "loglinear":
      prox = loglinear_proximal(logp, batch["behaviour_logprobs"], batch["token_staleness"])
    out = policy_loss(
        logp,
        batch["behaviour_logprobs"],
        batch["advantages"],
        batch["mask"],
        settings,
        proximal_logprobs=prox,
        token_staleness=batch["token_staleness"],
        totals=totals,
        ref_logprobs=ref_logp,
    )
    if stats is None:
      return out.loss, out.metrics
    # A micro-batch's share of the rows: summed over micro-batches, the router
    # terms are their row-weighted mean (one batch: weight 1).
    share = batch["mask"].shape[0] / totals.rows
    terms, moe_metrics = router_losses(stats, self.model_cfg.num_experts_per_tok,
                                       self.model_cfg.moe_layers, batch["mask"],
                                       batch["token_staleness"])
    loss = out.loss + share * (self.moe_aux_loss_coef * terms["load_balance"]
                               + self.cfg.moe_z_loss_coef * terms["z_loss"])
    metrics = dict(out.metrics)
    for k, v in moe_metrics.items():
      metrics[k] = v if k.endswith("_max") else share * v
    return loss, metrics

  @staticmethod
  def _interleave(batch: dict[str, jax.Array], k: int) -> dict[str, jax.Array]:
    """``[k, rows / k, ...]``: row ``j * k + i`` goes to part ``i``.

    With the batch sharded in contiguous blocks over (data, fsdp), every part
    then spans every device instead of living on a few of them.
    """
    rows = batch["advantages"].shape[0]
    return jax.tree.map(lambda x: x.reshape((rows // k, k) + x.shape[1:]).swapaxes(0, 1), batch)

  def _micro_batches(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array] | None:
    """``[k, micro, ...]`` micro-batches, or None when the batch is one."""
    rows = batch["advantages"].shape[0]
    micro = self.micro_batch
    if micro <= 0 or micro >= rows:
      return None
    if rows % micro:
      raise ValueError(f"batch of {rows} rows is not a multiple of micro_batch_size={micro}")
    return jax.lax.with_sharding_constraint(
        self._interleave(batch, rows // micro), NamedSharding(self.mesh, P(None, self.batch_axes)))

  @staticmethod
  def _reduce_metrics(stacked: dict[str, jax.Array], add) -> dict[str, jax.Array]:
    """Metrics stacked over parts -> one value each: ``*_max`` / ``*_min`` keys
    take the max / min, the rest ``add`` (sum over micro-batches, whose metrics
    are normalised by whole-batch totals; mean over minibatch updates)."""
    def one(k, v):
      if k.endswith("_max"):
        return v.max(0)
      if k.endswith("_min"):
        return v.min(0)
      return add(v, 0)
    return {k: one(k, v) for k, v in stacked.items()}

  def _gradients(self, params, batch, ref_params):
    """``(loss, metrics, grads)`` of one (mini)batch, accumulated over micro-batches."""
    totals = BatchTotals.of(batch["mask"], batch["token_staleness"])
    grad_fn = jax.value_and_grad(self._loss, has_aux=True)
    micro = self._micro_batches(batch)
    if micro is None:
      (loss, metrics), grads = grad_fn(params, batch, ref_params, totals)
      return loss, metrics, grads

    def accumulate(carry, mb):
      (l, m), g = grad_fn(params, mb, ref_params, totals)
      cl, cg = carry
      return (cl + l, jax.tree.map(jnp.add, cg, g)), m

    first = jax.tree.map(lambda x: x[0], micro)
    (l0, _), g0 = jax.eval_shape(grad_fn, params, first, ref_params, totals)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (l0, g0))
    # Accumulate gradients in the params' layout, not wherever GSPMD would guess.
    init = (zeros[0], jax.lax.with_sharding_constraint(zeros[1], self.state_sharding.params))
    (loss, grads), per_micro = jax.lax.scan(accumulate, init, micro)
    return loss, self._reduce_metrics(per_micro, jnp.sum), grads

  def _update(self, params, opt_state, batch, ref_params):
    loss, metrics, grads = self._gradients(params, batch, ref_params)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
    return params, opt_state, metrics

  def _train_step(self, state: TrainState, batch: dict[str, jax.Array]):
    k = self.ppo_minibatches
    if k == 1:
      params, opt_state, metrics = self._update(state.params, state.opt_state, batch, state.ref_params)
    else:
      if self.loss_settings.needs_proximal and self.loss_settings.proximal == "recompute":
        # pi_prox is the current version's policy: one forward pass before
        # the first update moves the parameters.
        prox = jax.lax.stop_gradient(self._trained_logprobs(state.params, batch))
        batch = dict(batch, proximal_logprobs=prox)
      minis = jax.lax.with_sharding_constraint(
          self._interleave(batch, k), NamedSharding(self.mesh, P(None, self.batch_axes)))

      def one_update(carry, mb):
        p, o = carry
        p, o, m = self._update(p, o, mb, state.ref_params)
        return (p, o), m

      (params, opt_state), per_update = jax.lax.scan(
          one_update, (state.params, state.opt_state), minis)
      metrics = self._reduce_metrics(per_update, jnp.mean)
    metrics["is_weight_min"] = jnp.where(jnp.isposinf(metrics["is_weight_min"]), 0.0,
                                         metrics["is_weight_min"])
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  # -- length-grouped step (host loop over micro-batches) ---------------------
  def _micro_gradients(self, params, micro, ref_params, totals: BatchTotals):
    (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
        params, micro, ref_params, totals)
    return loss, metrics, grads

  def _micro_accumulate(self, params, micro, ref_params, totals, acc):
    loss, metrics, grads = self._micro_gradients(params, micro, ref_params, totals)
    return (acc[0] + loss, jax.tree.map(jnp.add, acc[1], grads)), metrics

  def _apply_gradients(self, state: TrainState, grads, bump_step: bool):
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    step = state.step + 1 if bump_step else state.step
    return state.replace(step=step, params=params, opt_state=opt_state), optax.global_norm(grads)

  def _micro_plan(self, mask: np.ndarray):
    return plan_micro_batches(mask, min(self.micro_batch, len(mask)), self.seq_len_buckets)

  def _grouped_proximal(self, batch: dict[str, np.ndarray]) -> np.ndarray:
    """The current version's log-probs of every row, micro-batch by micro-batch."""
    out = np.zeros_like(batch["mask"])
    for micro in self._micro_plan(batch["mask"]):
      logp = self._logprobs_fn(self.state.params, self.put_batch(take_micro_batch(batch, micro)))
      out[micro.rows, :micro.positions] = np.asarray(jax.device_get(logp))
    return out

  def _grouped_train_step(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """The fused step's update, run as one jitted call per length-grouped micro-batch.

    Returns host metrics (the fused step's keys; ``positions_computed`` counts
    the positions the train passes ran, the fused step's is rows x positions);
    ``self.state`` holds the new version.
    """
    k = self.ppo_minibatches
    if k > 1 and self.loss_settings.needs_proximal and self.loss_settings.proximal == "recompute":
      batch = dict(batch, proximal_logprobs=self._grouped_proximal(batch))
    per_update, computed = [], 0
    for i in range(k):
      mini = {key: np.asarray(v)[i::k] for key, v in batch.items()} if k > 1 else batch
      totals = jax.device_put(
          BatchTotals.of(np.asarray(mini["mask"]), np.asarray(mini["token_staleness"]), xp=np),
          self.replicated)
      acc, micro_metrics = None, []
      for micro in self._micro_plan(mini["mask"]):
        placed = self.put_batch(take_micro_batch(mini, micro))
        computed += len(micro.rows) * micro.positions
        if acc is None:
          loss, metrics, grads = self._micro_grads_fn(self.state.params, placed,
                                                      self.state.ref_params, totals)
          acc = (loss, grads)
        else:
          acc, metrics = self._micro_accumulate_fn(self.state.params, placed,
                                                   self.state.ref_params, totals, acc)
        micro_metrics.append(metrics)
      loss, grads = acc
      self.state, grad_norm = self._apply_fn(self.state, grads, i == k - 1)
      per_update.append((micro_metrics, loss, grad_norm))
    updates = []
    for micro_metrics, loss, grad_norm in jax.device_get(per_update):
      stacked = {key: np.stack([m[key] for m in micro_metrics]) for key in micro_metrics[0]}
      updates.append(dict(self._reduce_metrics(stacked, np.sum), loss=loss, grad_norm=grad_norm))
    metrics = self._reduce_metrics({key: np.stack([u[key] for u in updates]) for key in updates[0]},
                                   np.mean)
    if np.isposinf(metrics["is_weight_min"]):
      metrics["is_weight_min"] = 0.0
    metrics["positions_computed"] = computed
    return metrics

  def warmup(self, batch_rows: int, seq_lens: Sequence[int]) -> None:
    """Compiles the train step for every ``[batch_rows, seq_len]`` shape ahead of time.

    Training rows are bucketed (``learner.seq_len_buckets``), so a run meets
    a handful of shapes; compiling them at start-up (MaxText-style AOT)
    keeps multi-second compiles out of the first steps that hit a new bucket,
    where they would stall the learner mid-run. Lowering never executes, so
    the (donated) state is untouched; the executables land in JAX's
    compilation cache that later calls hit.
    """
    if self.group_by_length:
      self._compile_grouped(batch_rows // self.ppo_minibatches, seq_lens)
      return
    for seq_len in sorted(set(int(s) for s in seq_lens)):
      self.compile_step(batch_rows, seq_len)

  def _compile_grouped(self, minibatch_rows: int, seq_lens: Sequence[int]) -> None:
    """The length-grouped step's programs: per-micro-batch ones for every bucket."""
    rows = min(self.micro_batch, minibatch_rows)
    params = self.state.params
    scalar = jax.ShapeDtypeStruct((), np.float32, sharding=self.replicated)
    totals = BatchTotals(*(scalar for _ in BatchTotals._fields))
    grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    loss = scalar
    for seq_len in sorted(set(int(s) for s in seq_lens)):
      micro = {key: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
               for key, (shape, dtype) in batch_shapes(rows, seq_len, self.routing).items()}
      settings = self.loss_settings
      if self.ppo_minibatches > 1 and settings.needs_proximal and settings.proximal == "recompute":
        self._logprobs_fn.lower(params, micro).compile()
        micro["proximal_logprobs"] = micro["mask"]
      self._micro_grads_fn.lower(params, micro, self.state.ref_params, totals).compile()
      self._micro_accumulate_fn.lower(params, micro, self.state.ref_params, totals,
                                      (loss, grads)).compile()
    # Only the last minibatch update of a step bumps the step counter.
    for bump_step in (True,) if self.ppo_minibatches == 1 else (False, True):
      self._apply_fn.lower(self.state, grads, bump_step).compile()

  def compile_step(self, batch_rows: int, seq_len: int) -> Any:
    """The compiled train step for ``[batch_rows, seq_len]`` rows (nothing runs).

    Its ``memory_analysis()`` is XLA's buffer assignment for the step: what
    ``benchmarks/learner_memory.py`` compares across memory settings.
    """
    batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
             for k, (shape, dtype) in batch_shapes(batch_rows, seq_len, self.routing).items()}
    return self._step_fn.lower(self.state, batch).compile()

  def batch_template(self, batch_rows: int, seq_len: int) -> dict[str, np.ndarray]:
    """Zeros shaped like a host batch of ``[batch_rows, seq_len]`` rows."""
    out = {k: np.zeros(shape, dtype)
           for k, (shape, dtype) in batch_shapes(batch_rows, seq_len, self.routing).items()}
    if "routing" in out:  # no route recorded (not expert 0 everywhere)
      out["routing"][...] = no_route(out["routing"].dtype)
    return out

  def detached_params(self, version: int | None = None, dtype: str | None = None) -> Any:
    """A device copy of the params that the next (donating) train step cannot clobber.

    What a background publish of ``version`` writes while training goes on;
    ``dtype``: floating leaves cast to the publisher's write dtype in the same
    copy (one bfloat16 copy, not a float32 copy and then a cast).
    """
    del version  # the multi-host leader broadcasts it; one process needs nothing
    return jax.block_until_ready(cast_copy(self.params, dtype))

  @property
  def batch_devices(self) -> int:
    """Devices a batch's rows are sharded over: row counts must be multiples of it."""
    return math.prod(self.mesh.shape[a] for a in self.batch_axes)

  def params_target(self) -> Any:
    """The params' shapes, dtypes and learner shardings: a restore target for a snapshot."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.params)

  def compile_logprobs(self, rows: int, seq_lens: Sequence[int]) -> None:
    """Compiles :meth:`logprobs_under` for ``[rows, seq_len]`` batches ahead of time (the
    audit's label check; like :meth:`warmup`, into the compilation cache)."""
    for seq_len in sorted(set(int(s) for s in seq_lens)):
      batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
               for k, (shape, dtype) in batch_shapes(rows, seq_len, self.routing).items()}
      self._logprobs_fn.lower(self.params_target(), batch).compile()

  def logprobs_under(self, params: Any, batch: dict[str, np.ndarray]) -> np.ndarray:
    """Log-probs of ``batch``'s masked targets under ``params`` (0 elsewhere), on the host.

    The training forward (whole sequences, no KV cache) on the learner's
    shardings, with any other parameters than the live ones: what the audit
    recomputes a span's behaviour log-probs with, under the snapshot of the
    version the span claims (issue 28).
    """
    return np.asarray(jax.device_get(self._logprobs_fn(params, self.put_batch(batch))))

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Places a host batch on the learner mesh (batch dim over data x fsdp x expert)."""
    return jax.device_put(batch, self.batch_sharding)

  def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """One optimizer step; raises :class:`TrainingDivergedError` on a NaN/inf metric.

    Checked here, on every step, because a non-finite loss or gradient norm
    silently poisons every later step (and every published version) while
    the run still looks healthy from the outside.
    """
    if self.group_by_length:
      metrics = self._grouped_train_step(batch)
    else:
      self.state, metrics = self._step_fn(self.state, self.put_batch(batch))
      metrics = dict(jax.device_get(metrics), positions_computed=np.size(batch["mask"]))
    out = {k: float(v) for k, v in metrics.items()}
    bad = {k: v for k, v in out.items() if not math.isfinite(v)}
    if bad:
      raise TrainingDivergedError(
          f"learner step {self.step}: non-finite {', '.join(f'{k}={v}' for k, v in sorted(bad.items()))};"
          " stopping before these parameters are published or checkpointed (lower"
          " learner.learning_rate, check rewards/advantages, or resume from the last checkpoint)")
    return out

  @property
  def step(self) -> int:
    return int(self.state.step)

  @property
  def params(self) -> Any:
    return self.state.params
