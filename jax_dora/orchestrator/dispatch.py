"""Routes rollout requests to servers and survives servers that die.

A request that fails because its server crashed is re-issued on another live
server with the same ``(sample_id, member)`` key, so a crash never loses a
sample and never produces two trajectories for one key (the failed attempt
never returned a result). Every re-issue is reported to the caller's
``on_reissue`` hook so the integrity ledger can account for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from jax_dora.rollout.api import (
    RolloutClient,
    RolloutError,
    RolloutRequest,
    RolloutResult,
    VersionUnavailableError,
)
from jax_dora.types import Prompt, TokenSpan, Trajectory

log = logging.getLogger(__name__)


class NoLiveServersError(RuntimeError):
  """Every rollout server has failed; the run cannot make progress."""


@dataclasses.dataclass
class _ServerSlot:
  client: RolloutClient
  in_flight: int = 0
  alive: bool = True
  failures: int = 0


class Dispatcher:
  """Least-loaded routing over rollout clients, with failover."""

  def __init__(
      self,
      clients: Sequence[RolloutClient],
      max_failures_per_server: int = 1,
      on_reissue: Callable[[int, int, str], None] | None = None,
  ):
    if not clients:
      raise ValueError("Dispatcher needs at least one rollout client")
    self._servers = [_ServerSlot(c) for c in clients]
    self._max_failures = max_failures_per_server
    self._on_reissue = on_reissue
    self._ids = itertools.count()
    self._active: dict[str, _ServerSlot] = {}

  @property
  def live_clients(self) -> list[RolloutClient]:
    return [s.client for s in self._servers if s.alive]

  @property
  def in_flight(self) -> int:
    return sum(s.in_flight for s in self._servers)

  def _pick(self) -> _ServerSlot:
    live = [s for s in self._servers if s.alive]
    if not live:
      raise NoLiveServersError("all rollout servers have failed")
    return min(live, key=lambda s: s.in_flight)

  async def broadcast_version(self, version: int) -> None:
    """Tells every live server to load ``version``; a dead one is retired."""

    async def load(s: _ServerSlot):
      try:
        await s.client.load_version(version)
      except RolloutError as e:
        self._mark_failed(s, e)

    await asyncio.gather(*(load(s) for s in self._servers if s.alive))
    if not self.live_clients:
      raise NoLiveServersError(f"no live rollout server could load version {version}")

  async def abort_all(self) -> None:
    """Aborts every request in flight (their results come back 'aborted')."""
    by_server: dict[int, list[str]] = {}
    for rid, s in list(self._active.items()):
      by_server.setdefault(id(s), []).append(rid)
    servers = {id(s): s for s in self._servers}
    await asyncio.gather(
        *(servers[k].client.abort(ids) for k, ids in by_server.items() if servers[k].alive),
        return_exceptions=True,
    )

  def _mark_failed(self, s: _ServerSlot, err: Exception) -> None:
    s.failures += 1
    if s.failures >= self._max_failures and s.alive:
      s.alive = False
      log.error("rollout server %s retired after failure: %s", s.client.name, err)

  async def run(
      self,
      prompt: Prompt,
      prompt_tokens: np.ndarray,
      member: int,
      max_new_tokens: int,
      *,
      version: int | None = None,
      resume: Trajectory | None = None,
      tag: str = "train",
      ignore_eos: bool = False,
  ) -> RolloutResult:
    """Runs one request to completion (or abort), failing over on crashes."""
    while True:
      s = self._pick()
      rid = f"{tag}-{prompt.sample_id}-{member}-{next(self._ids)}"
      req = RolloutRequest(
          request_id=rid,
          prompt_tokens=prompt_tokens,
          max_new_tokens=max_new_tokens,
          version=version,
          ignore_eos=ignore_eos,
      )
      if resume is not None and resume.num_completion_tokens:
        req.resume_tokens = resume.completion_tokens
        req.resume_logprobs = resume.behaviour_logprobs
        req.resume_spans = tuple(resume.spans)
      s.in_flight += 1
      self._active[rid] = s
      try:
        return await s.client.generate(req)
      except VersionUnavailableError:
        raise  # the caller pinned a version the server no longer holds: not a crash
      except RolloutError as e:
        self._mark_failed(s, e)
        if self._on_reissue is not None:
          self._on_reissue(prompt.sample_id, member, str(e))
        log.warning("request %s failed on %s (%s); re-issuing", rid, s.client.name, e)
      finally:
        s.in_flight -= 1
        self._active.pop(rid, None)


def to_trajectory(
    prompt: Prompt,
    prompt_tokens: np.ndarray,
    member: int,
    result: RolloutResult,
    submit_time: float,
) -> Trajectory:
  """Builds the learner-facing record from a server result."""
  spans = list(result.spans)
  return Trajectory(
      sample_id=prompt.sample_id,
      member=member,
      prompt=prompt,
      prompt_tokens=np.asarray(prompt_tokens, np.int32),
      completion_tokens=np.asarray(result.completion_tokens, np.int32),
      behaviour_logprobs=np.asarray(result.logprobs, np.float32),
      spans=spans,
      finish_reason=result.finish_reason,
      start_version=min((sp.version for sp in spans), default=result.prefill_version),
      submit_time=submit_time,
      finish_time=time.time(),
  )


def merge_spans(spans: Sequence[TokenSpan]) -> list[TokenSpan]:
  """Merges adjacent spans of the same version (after resumptions)."""
  out: list[TokenSpan] = []
  for sp in spans:
    if out and out[-1].version == sp.version and out[-1].end == sp.start:
      out[-1] = TokenSpan(out[-1].start, sp.end, sp.version)
    else:
      out.append(sp)
  return out
