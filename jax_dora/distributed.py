"""Joining the multi-host JAX runtime, shared by the learner and rollout servers."""

from __future__ import annotations

import logging
from typing import Any

import jax

log = logging.getLogger(__name__)


def maybe_initialize_distributed(cfg: Any) -> bool:
  """Calls ``jax.distributed.initialize`` when ``cfg.distributed.enabled``.

  With no explicit coordinator/process arguments JAX auto-detects the cluster
  (TPU metadata, SLURM, ...), which is the normal path on Cloud TPU; the
  explicit fields exist for local multi-process runs. Returns True if joined.
  """
  d = cfg.distributed
  if not d.enabled:
    return False
  kwargs: dict[str, Any] = {}
  if d.coordinator_address:
    kwargs["coordinator_address"] = d.coordinator_address
  if d.num_processes > 0:
    kwargs["num_processes"] = d.num_processes
  if d.process_id >= 0:
    kwargs["process_id"] = d.process_id
  jax.distributed.initialize(**kwargs)
  log.info("jax.distributed initialised: process %d of %d", jax.process_index(), jax.process_count())
  return True
