"""The rollout contract between the orchestrator and rollout servers.

One protocol, two transports: :class:`RolloutClient` is implemented by the
embedded client (in-process driver on local devices) and by the gRPC client
(remote JetStream-style server). The orchestrator only ever sees this file,
which is what lets the Colab/CPU path and the TPU-pod path be the same code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

import numpy as np

from jax_dora.types import TokenSpan


class RolloutError(RuntimeError):
  """A request could not be completed (server died, aborted, timed out).

  Carries the ids of every request that was in flight so that the caller can
  account for them (re-issue or record as failed) instead of losing them.
  """

  def __init__(self, message: str, failed_request_ids: tuple[str, ...] = ()):
    super().__init__(message)
    self.failed_request_ids = tuple(failed_request_ids)


class VersionUnavailableError(RolloutError):
  """The requested policy version is not (or no longer) loaded on the server."""


class IncarnationMismatchError(RolloutError):
  """The server holds another run incarnation's versions than the request's.

  A server restarted from a stale snapshot, or one still holding a killed
  run's versions, answers this instead of generating from parameters the
  learner never had; the caller loads the current version and retries.
  """


@dataclasses.dataclass(frozen=True)
class ResumeParts:
  """A completion so far, which a request continues: tokens, log-probs, version spans, routes.

  The typed form of a request's ``resume_*`` fields (the wire keeps them
  apart). The orchestrator builds one from its partial trajectory
  (:meth:`request_fields`); the server derives one per request at admission
  (:meth:`of`) and every result the request ends with starts with it.
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  spans: tuple[TokenSpan, ...] = ()
  routing: np.ndarray | None = None

  @classmethod
  def of(cls, req: RolloutRequest) -> ResumeParts:
    """A request's resume fields (none: empty). Raises ValueError when the log-probs
    do not match the tokens."""
    toks = (np.zeros((0,), np.int32) if req.resume_tokens is None
            else np.asarray(req.resume_tokens, np.int32))
    lps = (np.zeros((len(toks),), np.float32) if req.resume_logprobs is None
           else np.asarray(req.resume_logprobs, np.float32))
    if len(lps) != len(toks):
      raise ValueError(f"resume_logprobs has {len(lps)} entries for {len(toks)} resume_tokens")
    return cls(toks, lps, tuple(req.resume_spans), req.resume_routing)

  def __len__(self) -> int:
    return len(self.tokens)

  def request_fields(self) -> dict[str, object]:
    """The ``RolloutRequest`` fields that carry it (``RolloutRequest(..., **fields)``)."""
    return dict(resume_tokens=self.tokens, resume_logprobs=self.logprobs,
                resume_spans=tuple(self.spans), resume_routing=self.routing)


@dataclasses.dataclass
class RolloutRequest:
  """Generate up to ``max_new_tokens`` after ``prompt_tokens``.

  ``resume_*`` carry an interrupted rollout's prefix: the server continues it
  (with its newest version) and returns the *whole* completion with the spans
  of every version that wrote part of it.
  """

  request_id: str
  prompt_tokens: np.ndarray  # int32, starts with BOS
  max_new_tokens: int
  version: int | None = None  # None = newest loaded version (the DORA rule)
  # Run incarnation the version must belong to ("" = whatever the server holds).
  incarnation: str = ""
  resume_tokens: np.ndarray | None = None
  resume_logprobs: np.ndarray | None = None
  resume_spans: tuple[TokenSpan, ...] = ()
  # MoE: the routes recorded for prompt + resume so far (``[len(prompt) +
  # len(resume), moe_layers, k]``, ``jax_dora.model.routing``; the sentinel
  # where none was). The server keeps them and fills only the gaps from this
  # request's prefill, so the record stays the routing each token was
  # generated under across resumes and tool turns.
  resume_routing: np.ndarray | None = None
  # Generate exactly ``max_new_tokens`` (EOS does not end the request), as
  # vLLM's ``ignore_eos``: lets a benchmark fix every rollout's length to the
  # workload's instead of to whatever the policy currently emits.
  ignore_eos: bool = False
  # Send per-token RolloutChunks before the result. Callers that only want the
  # result (``RolloutClient.generate``) turn it off: over gRPC a chunk per
  # decode step per request costs more than the decode step itself.
  stream: bool = True
  # Multi-turn (tool calls): generation also ends, with finish_reason "stop",
  # right after the token that completes one of these strings (the tool-call
  # end marker); the completion keeps that token.
  stop_strings: tuple[str, ...] = ()
  # Multi-turn: a hold id. When the request ends, the server keeps its version
  # pinned under this id (never retired, as if a slot still used it) until a
  # request with the same hold is admitted (which takes the pin over and, with
  # version None, runs on the held version), ``abort([hold])`` releases it, or
  # the server's hold timeout passes. This is what keeps a trajectory's policy
  # version live on its server while a tool runs between two turns.
  hold: str = ""
  # Multi-turn: False = the hold does not pin this turn's version (a per-turn
  # version hop, ``orchestrator.turn_version=newest``): the version is released
  # when the turn ends and the next turn runs on the newest; the hold keeps only
  # the turn's cache entries (reused when the next turn's version is the same).
  keep_version: bool = True


@dataclasses.dataclass
class RolloutChunk:
  """Tokens streamed since the previous chunk, all from one version."""

  request_id: str
  tokens: np.ndarray
  logprobs: np.ndarray
  version: int


@dataclasses.dataclass
class RolloutResult:
  request_id: str
  completion_tokens: np.ndarray  # int32, includes EOS when finish_reason == "eos"
  logprobs: np.ndarray  # float32, behaviour log-prob per completion token
  spans: tuple[TokenSpan, ...]
  finish_reason: str  # "eos" | "length" | "aborted" | "stop" (a stop string)
  prefill_version: int  # version that computed the prompt's KV cache this time
  incarnation: str = ""  # run incarnation of the versions that generated it
  server: str = ""  # which server generated it (set by the dispatcher; hold affinity)
  # MoE: ``[len(prompt) + len(completion), moe_layers, k]`` the experts each
  # token was routed to when the server ran it (``jax_dora.model.routing``:
  # uint8 for up to 254 experts, the sentinel where none was, e.g. the last
  # token); None from a dense model. What routing replay trains with.
  routing: np.ndarray | None = None


@dataclasses.dataclass
class ServerStatus:
  versions_loaded: tuple[int, ...]
  newest_version: int | None
  active_slots: int
  total_slots: int
  queued_requests: int
  slot_versions: tuple[int, ...]  # pinned version per active slot
  generated_tokens: int  # since start
  busy_time_s: float  # wall time spent in prefill/generate since start
  decode_steps: int = 0  # generate calls since start
  # Decode passes since start: one per live version per step, so
  # decode_passes / decode_steps is the multi-version overhead factor.
  decode_passes: int = 0
  incarnation: str = ""  # run incarnation of the held versions ("" = none yet)
  # Prefill since start: context tokens of admitted requests, tokens actually
  # computed (less with group prefix sharing), and the resumed part of
  # contexts (an interrupted rollout's completion, prefilled again).
  prefill_requested_tokens: int = 0
  prefill_computed_tokens: int = 0
  resumed_prefill_tokens: int = 0
  held_versions: tuple[int, ...] = ()  # versions pinned by holds (multi-turn), one per hold
  # Snapshot loads refused because the restored parameters differ from the
  # checksums their publisher recorded (``SnapshotIntegrityError``), since start.
  snapshot_integrity_failures: int = 0
  # Multi-turn held KV (``rollout/held_kv.py``), since start: pool rows and
  # entries now; turns parked, turns resumed prefilling only their new tokens,
  # the context tokens those did not prefill again, and the held turns that
  # re-prefilled, by reason (``held_kv.FALLBACKS``).
  held_kv_rows: int = 0
  held_kv_entries: int = 0
  held_kv_parked: int = 0
  held_kv_resumed: int = 0
  held_kv_reused_tokens: int = 0
  held_kv_fallbacks: dict = dataclasses.field(default_factory=dict)


def health_reply(name: str, instance: str, status: ServerStatus) -> dict:
  """The Health answer of a live server (gRPC and embedded alike).

  ``instance`` is fixed for the server's lifetime: a new one at the same
  address means a restarted process. ``generated_tokens`` lets the
  dispatcher check that a server with requests in flight makes progress.
  """
  return {
      "live": True,
      "name": name,
      "instance": instance,
      "versions_loaded": list(status.versions_loaded),
      "newest_version": status.newest_version,
      "generated_tokens": int(status.generated_tokens),
      "active_slots": int(status.active_slots),
      "total_slots": int(status.total_slots),
      "queued_requests": int(status.queued_requests),
      "incarnation": status.incarnation,
  }


@runtime_checkable
class RolloutClient(Protocol):
  """What the orchestrator needs from one rollout server."""

  name: str

  async def load_version(self, version: int, incarnation: str | None = None) -> None:
    """Loads snapshot ``version`` from the snapshot directory (idempotent).

    After it returns, new requests with ``version=None`` start on it; older
    versions stay loaded while a slot still uses them (up to the server's cap).
    ``incarnation``: the run incarnation the snapshot must belong to; a server
    holding another incarnation's versions drops them (and fails the requests
    still running on them) first.
    """

  def stream(self, request: RolloutRequest) -> AsyncIterator[RolloutChunk]:
    """Streams tokens as they are generated; the last item is a RolloutResult.

    Raises RolloutError if the server fails mid-stream.
    """

  async def generate(self, request: RolloutRequest) -> RolloutResult:
    """Convenience: consume :meth:`stream` and return the final result."""

  async def abort(self, request_ids: list[str]) -> None:
    """Stops those requests; their streams end with finish_reason 'aborted'
    and the partial completion (tokens, logprobs, spans) so they can resume.
    An id naming a hold (``RolloutRequest.hold``) releases that hold."""

  async def status(self) -> ServerStatus:
    ...

  async def close(self) -> None:
    ...
