"""Sharded learner state and the jitted GRPO train step.

Parameters and optimizer state are laid out on the learner mesh from the
model's logical axis names (MaxText style): the boxed abstract state gives a
PartitionSpec per leaf, ``LOGICAL_AXIS_RULES`` maps it to mesh axes, and the
init and train step are jitted with those shardings so nothing is ever
materialised unsharded on one device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dora.learner.grpo import grpo_loss
from jax_dora.learner.mesh import LOGICAL_AXIS_RULES
from jax_dora.model import ModelConfig, Transformer, token_logprobs


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  ref_params: Any = None


def make_optimizer(cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW with linear warmup and gradient clipping (standard RL-finetune recipe)."""
  warmup = max(int(cfg.warmup_steps), 1)
  schedule = optax.join_schedules(
      [
          # Start at lr / warmup, not 0, so the very first update moves the policy.
          optax.linear_schedule(cfg.learning_rate / warmup, cfg.learning_rate, warmup),
          optax.constant_schedule(cfg.learning_rate),
      ],
      [warmup],
  )
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=cfg.weight_decay),
  )


class Learner:
  """Owns the sharded train state on ``mesh`` and runs GRPO updates."""

  def __init__(
      self,
      model_cfg: ModelConfig,
      learner_cfg: ml_collections.ConfigDict,
      mesh: Mesh,
      *,
      temperature: float = 1.0,
      seed: int = 0,
  ):
    self.model_cfg = model_cfg
    self.cfg = learner_cfg
    self.mesh = mesh
    self.temperature = float(temperature)
    self.model = Transformer(model_cfg)
    self.tx = make_optimizer(learner_cfg)
    self.use_ref = learner_cfg.kl_coef > 0.0

    rng = jax.random.PRNGKey(seed)
    abstract = jax.eval_shape(self._init_boxed_state, rng)
    specs = nn.get_partition_spec(abstract)
    with nn.logical_axis_rules(LOGICAL_AXIS_RULES):
      self.state_sharding = nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_AXIS_RULES)
    self.batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    self.replicated = NamedSharding(mesh, P())
    init = jax.jit(
        lambda r: nn.meta.unbox(self._init_boxed_state(r)), out_shardings=self.state_sharding
    )
    self.state: TrainState = init(rng)
    self._step_fn = jax.jit(
        self._train_step,
        in_shardings=(self.state_sharding, self.batch_sharding),
        out_shardings=(self.state_sharding, self.replicated),
        donate_argnums=(0,),
    )

  # -- construction ---------------------------------------------------------
  def _init_boxed_state(self, rng: jax.Array) -> TrainState:
    s = self.model_cfg.max_seq_len
    tokens = jnp.zeros((1, s), jnp.int32)
    positions = jnp.arange(s, dtype=jnp.int32)[None]
    params = self.model.init(rng, tokens, positions)["params"]
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=self.tx.init(params),
        ref_params=params if self.use_ref else None,
    )

  # -- training -------------------------------------------------------------
  def _loss(self, params, batch, ref_params):
    logits = self.model.apply({"params": params}, batch["inputs"], batch["positions"])
    logp = token_logprobs(logits / self.temperature, batch["targets"])
    ref_logp = None
    if ref_params is not None:
      ref_logits = self.model.apply({"params": ref_params}, batch["inputs"], batch["positions"])
      ref_logp = jax.lax.stop_gradient(token_logprobs(ref_logits / self.temperature, batch["targets"]))
    out = grpo_loss(
        logp,
        batch["behaviour_logprobs"],
        batch["advantages"],
        batch["mask"],
        clip_eps=self.cfg.clip_eps,
        clip_eps_high=self.cfg.clip_eps_high,
        kl_coef=self.cfg.kl_coef,
        ref_logprobs=ref_logp,
    )
    return out.loss, out.metrics

  def _train_step(self, state: TrainState, batch: dict[str, jax.Array]):
    (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(
        state.params, batch, state.ref_params
    )
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def warmup(self, batch_rows: int, seq_lens: Sequence[int]) -> None:
    """Compiles the train step for every ``[batch_rows, seq_len]`` shape ahead of time.

    Training rows are bucketed (``learner.seq_len_buckets``), so a run meets
    a handful of shapes; compiling them at start-up (MaxText-style AOT)
    keeps multi-second compiles out of the first steps that hit a new bucket,
    where they would stall the learner mid-run. Lowering never executes, so
    the (donated) state is untouched; the executables land in JAX's
    compilation cache that later calls hit.
    """
    for seq_len in sorted(set(int(s) for s in seq_lens)):
      t = seq_len - 1

      def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)

      batch = {
          "inputs": spec((batch_rows, t), jnp.int32),
          "targets": spec((batch_rows, t), jnp.int32),
          "positions": spec((batch_rows, t), jnp.int32),
          "mask": spec((batch_rows, t), jnp.float32),
          "behaviour_logprobs": spec((batch_rows, t), jnp.float32),
          "advantages": spec((batch_rows,), jnp.float32),
      }
      self._step_fn.lower(self.state, batch).compile()

  def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Places a host batch on the learner mesh (batch dim over data x fsdp)."""
    return jax.device_put(batch, self.batch_sharding)

  def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    self.state, metrics = self._step_fn(self.state, self.put_batch(batch))
    return {k: float(v) for k, v in jax.device_get(metrics).items()}

  @property
  def step(self) -> int:
    return int(self.state.step)

  @property
  def params(self) -> Any:
    return self.state.params
