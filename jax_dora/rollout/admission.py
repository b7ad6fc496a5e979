"""Admission: a queued request is checked, pinned to its version, and given its context and budget.

A request runs on the version it names, else on its hold's pinned version (the
next turn of a multi-turn trajectory), else on the newest held version (the DORA
rule for new work; also a next turn whose hold pins nothing: a per-turn hop). Admission takes a pin on that version in the
:class:`~jax_dora.rollout.version_store.VersionStore` (a hold's pin is taken
over), so the version cannot retire under the slot. A request that cannot run
is answered here instead: another run incarnation's, a version no longer
held, a malformed request (its pin released), or a resumed request with no
budget left (a "length" result carrying what it came with).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jax_dora.model import routing
from jax_dora.model.config import ModelConfig
from jax_dora.rollout import api
from jax_dora.rollout.api import ResumeParts
from jax_dora.rollout.request_output import unstarted_result
from jax_dora.rollout.version_holds import VersionHolds
from jax_dora.rollout.version_store import VersionStore

Item = api.RolloutChunk | api.RolloutResult | api.RolloutError


@dataclasses.dataclass
class Queued:
  request: api.RolloutRequest
  callback: Callable[[Item], None]
  stream: bool = True


@dataclasses.dataclass(frozen=True)
class Admitted:
  """A request cleared to prefill: its pinned version, context (prompt + resume), budget."""

  version: int
  context: np.ndarray
  budget: int
  resume: ResumeParts


def _check_resume_routing(req: api.RolloutRequest, context_len: int, model_cfg: ModelConfig,
                          routing_shape: tuple[int, ...] | None) -> None:
  """A request's recorded routes must be this model's, one row per context token."""
  rec = req.resume_routing
  if rec is None:
    return
  if routing_shape is None:
    raise ValueError("resume_routing sent to a dense model's server")
  want = (context_len,) + routing_shape
  dtype = routing.routing_dtype(model_cfg.num_experts)
  if tuple(np.shape(rec)) != want or np.asarray(rec).dtype != dtype:
    raise ValueError(f"resume_routing is {np.asarray(rec).dtype}{list(np.shape(rec))}, this"
                     f" model records {dtype}{list(want)} (prompt + resume tokens, MoE layers, k)")


def admit(req: api.RolloutRequest, *, name: str, store: VersionStore, holds: VersionHolds,
          incarnation: str | None, max_seq_len: int, model_cfg: ModelConfig,
          routing_shape: tuple[int, ...] | None) -> Admitted | Item:
  """``Admitted`` (holding a version pin), or the item that answers ``req`` now."""
  if req.incarnation and req.incarnation != incarnation:
    return api.IncarnationMismatchError(
        f"{name}: request {req.request_id} is for run incarnation {req.incarnation}, this"
        f" server holds {incarnation}", (req.request_id,))
  held = holds.version_of(req.hold)
  want = req.version if req.version is not None or held is None else held
  try:
    version = store.acquire(want)
  except api.VersionUnavailableError as e:
    return api.VersionUnavailableError(f"{name}: {e}", (req.request_id,))
  if req.hold and req.hold in holds:
    holds.release([req.hold], store)  # the new turn's own pin replaces the hold's (if any)
  try:
    resume = ResumeParts.of(req)
    prompt = np.asarray(req.prompt_tokens, np.int32).reshape(-1)
    context = np.concatenate([prompt, resume.tokens])
    budget = min(int(req.max_new_tokens) - len(resume), max_seq_len - len(context))
    if len(prompt) == 0:
      raise ValueError("empty prompt_tokens")
    if len(context) >= max_seq_len:
      raise ValueError(f"prompt + resume = {len(context)} tokens leaves no room in max_seq_len="
                       f"{max_seq_len}")
    _check_resume_routing(req, len(context), model_cfg, routing_shape)
  except ValueError as e:
    store.release(version)
    return api.RolloutError(f"{name}: bad request: {e}", (req.request_id,))
  if budget <= 0:  # Resumed with nothing left to generate.
    store.release(version)
    return unstarted_result(req, "length", incarnation or "", version)
  return Admitted(version, context, budget, resume)
