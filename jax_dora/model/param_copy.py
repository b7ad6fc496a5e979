"""A fresh copy of a parameter tree, floating leaves cast, on the same devices.

Shared by the learner (``TrainState.detached_params``: the copy a background
publish reads while the next, donating, step trains) and the in-memory
snapshots (``snapshots.memory``): one jitted copy, so a version handed to
servers costs one device copy in the servers' dtype, not a float32 copy and
then a cast.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def cast_copy(params: PyTree, dtype: str | None) -> PyTree:
  """A fresh copy of ``params`` (floating leaves cast to ``dtype`` if given) on the same
  devices and shardings.

  Fresh: the learner's next step donates its parameter buffers, so a version
  handed to servers must own its own. Cast on the learner's devices: the copy
  then weighs what servers hold (half the bytes for bfloat16 servers).
  """
  return _copy(params, None if not dtype else jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=1)
def _copy(params: PyTree, dtype) -> PyTree:
  def one(x):
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
      return x.astype(dtype)
    return jnp.copy(x)  # a copy primitive: a new buffer, never the input forwarded
  return jax.tree.map(one, params)
