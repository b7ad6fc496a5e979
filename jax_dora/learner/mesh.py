"""Device meshes and the logical-to-physical sharding rules.

The learner and the rollout servers get *disjoint* device sets (on a TPU pod:
different slices; on CPU tests: forced host devices 0..k-1 vs k..n-1), so that
rollout never steals learner FLOPs and version swaps never stall training.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

# "expert": expert parallelism for MoE policies. Rows are split over it like
# over data (each expert shard sees its own tokens, as in MaxText), the experts
# of every MoE layer are divided among its devices, the rest of the model is
# replicated over it. Size 1 (the default) changes nothing.
MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")

# Logical axis names used by jax_dora.model -> mesh axes. "batch" spans both
# data and fsdp so activations shard the same way as in MaxText's FSDP setup.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("length", None),
    ("norm", None),
    ("layers", None),  # the stacked-layers axis of a scanned model: every device holds every layer
    # MoE experts [expert, embed, mlp]: over the expert axis; each expert's
    # hidden axis over "tensor" as the dense MLP's is.
    ("expert", "expert"),
)


def logical_axis_rules(n_kv_heads: int, tensor: int) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """``LOGICAL_AXIS_RULES`` for a model with ``n_kv_heads`` on a mesh whose ``tensor`` axis has
  ``tensor`` devices: key/value heads that do not divide over it (Gemma 3 1B has one) are
  replicated, as the rollout servers' placement does; everything else as the table says."""
  if n_kv_heads % tensor == 0:
    return LOGICAL_AXIS_RULES
  return tuple((name, None if name == "kv_heads" else axes) for name, axes in LOGICAL_AXIS_RULES)


def split_devices(
    num_learner: int, num_rollout: int, devices: Sequence[jax.Device] | None = None
) -> tuple[list[jax.Device], list[jax.Device]]:
  """Splits local devices into disjoint learner and rollout sets.

  ``num_learner == -1`` gives the learner every device the rollout does not
  take. With a single device (plain CPU) both roles share it: that is the
  only case where they overlap, and it is logged by the caller.
  """
  devices = list(devices if devices is not None else jax.devices())
  if len(devices) == 1:
    return devices, devices
  if num_rollout >= len(devices):
    raise ValueError(
        f"rollout wants {num_rollout} devices but only {len(devices)} exist;"
        " leave at least one for the learner"
    )
  if num_learner == -1:
    num_learner = len(devices) - num_rollout
  if num_learner + num_rollout > len(devices):
    raise ValueError(
        f"learner ({num_learner}) + rollout ({num_rollout}) devices exceed the"
        f" {len(devices)} available"
    )
  return devices[:num_learner], devices[num_learner:num_learner + num_rollout]


def resolve_mesh_shape(num_devices: int, data: int, fsdp: int, tensor: int,
                       expert: int = 1) -> tuple[int, int, int, int]:
  """``(data, fsdp, expert, tensor)``, one ``-1`` entry resolved so the product is ``num_devices``."""
  shape = [data, fsdp, expert, tensor]
  if shape.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {shape}")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"{num_devices} devices not divisible by mesh {shape}")
    shape[shape.index(-1)] = num_devices // known
  if int(np.prod(shape)) != num_devices:
    raise ValueError(f"mesh {shape} needs {int(np.prod(shape))} devices, have {num_devices}")
  return tuple(shape)  # type: ignore[return-value]


def make_mesh(devices: Sequence[jax.Device], data: int = -1, fsdp: int = 1, tensor: int = 1,
              expert: int = 1) -> Mesh:
  """Builds a (data, fsdp, expert, tensor) mesh over exactly ``devices``."""
  shape = resolve_mesh_shape(len(devices), data, fsdp, tensor, expert)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)
