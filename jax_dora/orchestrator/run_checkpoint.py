"""Checkpoint/resume of a whole run with Orbax.

A run's state is more than the learner: to resume without losing or repeating
data we also store the prompt stream's position, the policy version counter
and every prompt that had been *issued but not yet trained* (in flight on a
server or waiting in the pool). Those prompts are re-issued, with their
original sample ids, when the run resumes; trajectories from the killed run
are never reused, so no sample is trained twice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jax_dora.orbax_roles import (
  SAVE_LOCK,
  absolute_path,
  manager_kwargs,
  multiprocessing_options,
  savable,
)
from jax_dora.types import Prompt

log = logging.getLogger(__name__)


def prompt_to_json(p: Prompt) -> dict[str, Any]:
  return dataclasses.asdict(p)


def prompt_from_json(d: dict[str, Any]) -> Prompt:
  return Prompt(**d)


class RunCheckpointer:
  """Saves ``(learner TrainState, run metadata)`` at step boundaries."""

  def __init__(
      self,
      directory: str | epath.Path,
      max_to_keep: int = 2,
      processes: Collection[int] | None = None,
  ):
    """``processes``: under ``jax.distributed``, the learner's processes
    (``None`` = every process of the cluster), so that Orbax barriers and
    primary-host writes never involve rollout-server processes."""
    self.directory = absolute_path(directory)
    manager_kw, options_kw = manager_kwargs(
        self.directory,
        multiprocessing_options(processes, "jax_dora_run_checkpoint"),
        "state",
        "meta",
    )
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, **options_kw),
        **manager_kw,
    )

  def latest_step(self) -> int | None:
    self._manager.reload()
    return self._manager.latest_step()

  def discard_after(self, step: int) -> list[int]:
    """Deletes every checkpoint newer than ``step``; returns the steps removed.

    A fresh run (``checkpoint.resume=False``) in a directory that holds an
    earlier run calls this with 0: otherwise the earlier run's later
    checkpoints would survive next to the new run's, and the next resume would
    silently continue the wrong run.
    """
    self._manager.reload()
    removed = sorted(s for s in self._manager.all_steps() if s > step)
    for s in removed:
      self._manager.delete(s)
    if removed:
      log.warning("discarded run checkpoints %s (newer than step %d) in %s",
                  removed, step, self.directory)
    return removed

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Saves ``step``; replaces an existing checkpoint of the same step.

    The end-of-run checkpoint can land on the step a periodic one already
    saved; it supersedes it because the stream has moved on since and the
    pending prompts changed with it (the two are only valid as a pair).
    """
    with SAVE_LOCK:  # one Orbax save at a time in this process (orbax_roles.SAVE_LOCK)
      self._manager.reload()
      if step in self._manager.all_steps():
        self._manager.delete(step)
      self._manager.save(
          step,
          args=ocp.args.Composite(
              state=ocp.args.StandardSave(savable(state)), meta=ocp.args.JsonSave(meta)
          ),
          force=True,
      )
      self._manager.wait_until_finished()
    log.info("run checkpoint saved at step %d -> %s", step, self.directory)

  def restore(self, step: int, target_state: Any) -> tuple[Any, dict[str, Any]]:
    """Restores onto the shardings of ``target_state`` (the fresh learner state)."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
    out = self._manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        ),
    )
    return out.state, dict(out.meta)

  def all_steps(self) -> list[int]:
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def restore_unsharded(self, step: int) -> dict[str, Any]:
    """The saved train state of ``step`` as nested dicts on this host's first device.

    For tools without a learner (export): the shapes come from the
    checkpoint's own metadata, not from a live ``TrainState``.
    """
    meta = self._manager.item_metadata(step)["state"]
    tree = meta.tree if hasattr(meta, "tree") else meta
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    out = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    return out.state

  def close(self) -> None:
    self._manager.close()
