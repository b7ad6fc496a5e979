"""Where a rollout server's arrays live: its mesh, every sharding, and the parameter layout.

The engine builds a ``("slots", "tensor")`` mesh over the server's devices,
``tensor_parallel`` devices on the second axis. Params are laid out by the
model's logical axes with heads, KV heads, MLP width and vocabulary over
``"tensor"`` (Megatron-style tensor parallelism, so a 7B-class policy fits a
server of small chips) and replicated over ``"slots"``; with
``tensor_parallel=1`` they are fully replicated and decode needs no
collective. An MoE layer's experts are split over the chips. The decode
state's slot (batch) axis is sharded over ``"slots"`` when ``num_slots``
divides evenly, the KV cache's heads over ``"tensor"``; prefixes (batch 1)
follow the same head split.

Snapshots and checkpoints hold the per-layer layout; with ``scan_layers`` the
programs take the layers stacked (DESIGN.md, "Scanning over layers"), so a
version is restored per layer and stacked once (:meth:`EnginePlacement.load_params`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dora.model import KVCache, ModelConfig, param_logical_specs, stack_layers
from jax_dora.model import abstract_params as model_abstract_params
from jax_dora.rollout.engine_types import DecodeState, Params, Prefix
from jax_dora.snapshots import SnapshotReader, abstract_target_like


def _check_divisible(model_cfg: ModelConfig, tp: int) -> None:
  # Not n_kv_heads: fewer key/value heads than chips are replicated (``kv_heads_axis``).
  split = ("n_heads", "d_ff", "vocab_size")
  if model_cfg.num_experts:
    split += ("num_experts",)  # an MoE layer's experts are divided among the chips
  if model_cfg.shared_expert_d_ff:
    split += ("shared_expert_d_ff",)
  for name in split:
    if getattr(model_cfg, name) % tp:
      raise ValueError(f"model.{name}={getattr(model_cfg, name)} is not divisible by"
                       f" rollout.tensor_parallel={tp}")


class EnginePlacement:
  """The mesh and shardings of one server, and its parameters' restore and layout."""

  def __init__(self, model_cfg: ModelConfig, devices: Sequence[jax.Device], num_slots: int,
               tensor_parallel: int = 1, scan_layers: bool = False):
    tp = int(tensor_parallel)
    devices = list(devices)
    if tp < 1 or len(devices) % tp:
      raise ValueError(f"tensor_parallel={tp} does not divide the server's {len(devices)} devices")
    _check_divisible(model_cfg, tp)
    self.model_cfg = model_cfg
    self.scan_layers = bool(scan_layers)
    self.mesh = Mesh(np.array(devices).reshape(len(devices) // tp, tp), ("slots", "tensor"))
    self.replicated = NamedSharding(self.mesh, P())
    self.heads_axis = "tensor" if tp > 1 else None
    # Key/value heads (their projections and the KV cache) split like the query heads when
    # they divide evenly, else replicated on every chip: Gemma 3 1B has one KV head, and
    # each chip then computes it for its own query heads. vLLM replicates each KV head on
    # just the ranks whose query heads read it (the same thing for one head); here every
    # chip holds every KV head, the whole cache (n_kv_heads x head_dim per token: small
    # when n_kv_heads < tensor_parallel).
    self.kv_heads_axis = self.heads_axis if model_cfg.n_kv_heads % tp == 0 else None
    self.slot_axis = "slots" if num_slots % (len(devices) // tp) == 0 else None
    # The per-layer (snapshot, checkpoint) layout's shardings, and the
    # programs' (stacked under "layers" with scan_layers).
    self.param_sharding = self._param_sharding(stacked=False)
    self.program_param_sharding = self._param_sharding(stacked=self.scan_layers)
    self.state = self.decode_state_sharding(self.slot_axis)
    cache = NamedSharding(self.mesh, P(None, None, self.kv_heads_axis))
    r = self.replicated
    self.prefix = Prefix(cache=KVCache(k=cache, v=cache), token=r, logprob=r, true_length=r,
                         version=r)
    self._abstract_params: Params | None = None
    self._snapshot_abstract: Params | None = None
    self._stack_fn = None

  def _param_sharding(self, stacked: bool) -> Params:
    """Per-param shardings: model-parallel axes over ``"tensor"``, the rest
    replicated; ``stacked``: of the scanned layout (``stack_layers``).

    An MoE layer's experts are split over the chips (``expert`` first: a
    mesh axis is used once per array, so an expert's own ``mlp`` axis then
    stays whole on its chip, and each chip runs its own experts' matmuls)."""
    rules = tuple((name, self.heads_axis) for name in ("vocab", "heads", "expert", "mlp"))
    rules += (("kv_heads", self.kv_heads_axis),)
    rules += tuple((name, None) for name in ("embed", "kv", "norm", "layers"))
    specs = param_logical_specs(self.model_cfg)
    if stacked:
      specs = stack_layers(specs, self.model_cfg.n_layers)
    with nn.logical_axis_rules(rules):
      return nn.logical_to_mesh_sharding(specs, self.mesh, rules)

  def decode_state_sharding(self, slot_axis: str | None) -> DecodeState:
    row = NamedSharding(self.mesh, P(slot_axis))
    cache = NamedSharding(self.mesh, P(None, slot_axis, self.kv_heads_axis))
    return DecodeState(cache=KVCache(k=cache, v=cache), tokens=row, positions=row, lengths=row,
                       version=row, active=row, rng=self.replicated)

  def held_pool(self, rows: int) -> KVCache:
    """Sharding of the held-KV pool (``rollout/held_kv.py``): the decode cache's layout,
    rows split over ``"slots"`` when they divide evenly."""
    n = self.mesh.shape["slots"]
    cache = NamedSharding(self.mesh, P(None, "slots" if rows % n == 0 else None,
                                       self.kv_heads_axis))
    return KVCache(k=cache, v=cache)

  def step_accumulators(self, routed: bool) -> tuple:
    """Shardings of a decode step's accumulators (``DeviceSteps.empty_acc``)."""
    st = self.state
    # New entries are [L, B, 1, Hkv, D] (not the cache's head-major layout).
    new = NamedSharding(self.mesh, P(None, self.slot_axis, None, self.kv_heads_axis))
    routes = st.tokens if routed else None  # [B, moe_layers, k]
    return (KVCache(k=new, v=new), st.tokens, st.tokens, st.tokens, self.replicated, routes)

  # ------------------------------------------------------------------- params
  def abstract_params(self) -> Params:
    """Shape/dtype/sharding of the params the programs take (what ``load_params``
    and ``place_params`` return; stacked with ``scan_layers``).

    Computed once: tracing the Flax init costs more than the Orbax read of a
    small model, and every version load needs it.
    """
    if self._abstract_params is None:
      shapes = model_abstract_params(self.model_cfg)  # the shared, cached init trace
      if self.scan_layers:
        shapes = stack_layers(shapes, self.model_cfg.n_layers)
      self._abstract_params = abstract_target_like(shapes, self.program_param_sharding)
    return self._abstract_params

  def snapshot_target(self) -> Params:
    """The per-layer layout snapshots hold, on ``param_sharding``: the restore target."""
    if not self.scan_layers:
      return self.abstract_params()
    if self._snapshot_abstract is None:
      self._snapshot_abstract = abstract_target_like(model_abstract_params(self.model_cfg),
                                                     self.param_sharding)
    return self._snapshot_abstract

  def program_layout(self, params: Params) -> Params:
    """Per-layer params (on ``param_sharding``) -> what the programs take."""
    if not self.scan_layers:
      return params
    if self._stack_fn is None:
      self._stack_fn = jax.jit(functools.partial(stack_layers, n_layers=self.model_cfg.n_layers),
                               out_shardings=self.program_param_sharding)
    return self._stack_fn(params)

  def load_params(self, reader: SnapshotReader, version: int, incarnation: str | None = None
                  ) -> Params:
    """Restores snapshot ``version`` (of run ``incarnation``) onto this server's devices."""
    params, _ = reader.load(int(version), target=self.snapshot_target(), incarnation=incarnation)
    return self.program_layout(params)

  def place_params(self, params: Params) -> Params:
    """Copies an in-memory param tree onto the devices, param dtype and program
    layout: a per-layer tree (a checkpoint's, the learner's) or one already
    stacked (another scanned engine's ``load_params``, which embedded servers share)."""
    if self.scan_layers and "layers" in params:
      target, sharding = self.abstract_params(), self.program_param_sharding
    else:
      target, sharding = self.snapshot_target(), self.param_sharding
    placed = jax.device_put(jax.tree.map(lambda x, a: x.astype(a.dtype), params, target), sharding)
    return placed if "layers" in placed else self.program_layout(placed)
