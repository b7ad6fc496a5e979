"""Multi-turn turns over gRPC without the context both ends already hold (issue 39).

A tool-calling trajectory's next turn is a :class:`~jax_dora.rollout.api.RolloutRequest`
that carries everything so far (prompt + every turn + the observation), and its
result carries the whole completion back: on a remote server every turn ships
the context both ways, quadratic in turns, although the server produced all of
it but the observation and the client received all of it. Held KV
(``held_kv.py``) already spares the *prefill*; this spares the *wire*.

Both ends of one gRPC connection remember, per hold id, the context as of the
turn that just ended there (prompt + the completion it returned; a
:class:`HeldContexts` table each). The next turn of that hold on the same
connection then travels as a :class:`~jax_dora.rollout.wire.ResumeDelta`: only
what the orchestrator appended (the observation, and whatever a turn adds
beyond the base), plus the base's length and CRC32. The server rebuilds the
full request from its copy before the driver sees it, so nothing above the
client and the server's handler ever sees a delta, and the held-KV match, the
version rules and the results are exactly those of a full request. Results
come back as a :class:`~jax_dora.rollout.wire.ResultDelta`: the completion
after the request's own context, which the client puts back.

Why it cannot corrupt a trajectory:

* The client sends a delta only when the request's prompt and resume prefix
  are *equal* (token ids, log-probs, routes) to the base it remembers;
  anything else (another server, a restarted trajectory, a hop) goes in full.
* The server expands only from a base of the same length and CRC32; otherwise
  it answers :class:`~jax_dora.rollout.wire.ResumeBaseMissingError` before the
  driver is involved, and the client sends the same request again in full
  (counted: ``base_missing``). A restarted server has no bases.
* The server strips from a result only a prefix it checked equal to what the
  request carried (for MoE routes this excludes rows the prefill filled).
* Bases are dropped when a hold's turn ends without a tool call, when the hold
  is released (``abort([hold])``), and least recently used past ``capacity``.

Spans travel whole in both directions (a few tuples; a span may cross the
base's end).
"""

from __future__ import annotations

import collections
import dataclasses
import zlib

import numpy as np

from jax_dora.rollout import api
from jax_dora.rollout import wire

# Bases kept per connection end. A base is host memory of a few token arrays
# (kilobytes); one per trajectory waiting on a tool, so a few per decode slot.
DEFAULT_CAPACITY = 4096

# How a Generate request went out (client counters).
SENT_AS = ("full", "delta", "base_missing")


@dataclasses.dataclass(frozen=True)
class Base:
  """What one end holds of a hold's context: the prompt and the completion so far."""

  prompt_tokens: np.ndarray
  tokens: np.ndarray
  logprobs: np.ndarray
  routing: np.ndarray | None  # [len(prompt) + len(tokens), moe_layers, k] or None

  @property
  def crc(self) -> int:
    """CRC32 of every array's bytes (both ends compute it over their own copy)."""
    crc = 0
    for a in (self.prompt_tokens, self.tokens, self.logprobs, self.routing):
      if a is not None:
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return crc


class HeldContexts:
  """Hold id -> :class:`Base`, at most ``capacity`` (least recently used out)."""

  def __init__(self, capacity: int = DEFAULT_CAPACITY):
    self.capacity = int(capacity)
    self._bases: collections.OrderedDict[str, Base] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._bases)

  def get(self, hold: str) -> Base | None:
    base = self._bases.get(hold)
    if base is not None:
      self._bases.move_to_end(hold)
    return base

  def forget(self, ids) -> None:
    """Drops the bases of these holds (``abort`` ids: request ids and holds share it)."""
    for i in ids:
      self._bases.pop(i, None)

  def after_result(self, request: api.RolloutRequest, result: api.RolloutResult) -> None:
    """Keeps ``result`` as the base of ``request.hold`` when the turn ended at a tool call
    (another turn follows), else drops it (the trajectory is done or starts over)."""
    if not request.hold:
      return
    if result.finish_reason != "stop" or self.capacity <= 0:
      self._bases.pop(request.hold, None)
      return
    self._bases[request.hold] = Base(
        np.asarray(request.prompt_tokens, np.int32), np.asarray(result.completion_tokens, np.int32),
        np.asarray(result.logprobs, np.float32),
        None if result.routing is None else np.asarray(result.routing))
    self._bases.move_to_end(request.hold)
    while len(self._bases) > self.capacity:
      self._bases.popitem(last=False)


def _starts_with(a: np.ndarray | None, prefix: np.ndarray | None, n: int) -> bool:
  """``a[:n]`` equals ``prefix[:n]`` bit for bit (both present and long enough)."""
  if a is None or prefix is None or len(a) < n or len(prefix) < n:
    return False
  return (a.dtype == prefix.dtype and a.shape[1:] == prefix.shape[1:]
          and np.asarray(a[:n]).tobytes() == np.asarray(prefix[:n]).tobytes())


def encode_request(contexts: HeldContexts, request: api.RolloutRequest
                   ) -> api.RolloutRequest | wire.ResumeDelta:
  """The request as it goes on the wire: a delta when its context extends the base of its
  hold held here (and so at the server), else the request itself."""
  base = contexts.get(request.hold) if request.hold else None
  if base is None or request.resume_tokens is None:
    return request
  resume = api.ResumeParts.of(request)
  n, p = len(base.tokens), len(base.prompt_tokens)
  prompt = np.asarray(request.prompt_tokens, np.int32)
  if not (len(prompt) == p and _starts_with(prompt, base.prompt_tokens, p)
          and _starts_with(resume.tokens, base.tokens, n)
          and _starts_with(resume.logprobs, base.logprobs, n)):
    return request
  routing = None
  if (base.routing is None) != (resume.routing is None):
    return request
  if resume.routing is not None:
    if not _starts_with(resume.routing, base.routing, p + n):
      return request
    routing = resume.routing[p + n:]
  tail = dataclasses.replace(
      request, prompt_tokens=np.zeros((0,), np.int32), resume_tokens=resume.tokens[n:],
      resume_logprobs=resume.logprobs[n:], resume_routing=routing)
  return wire.ResumeDelta(tail, n, base.crc)


def expand_request(contexts: HeldContexts, msg: api.RolloutRequest | wire.ResumeDelta
                   ) -> api.RolloutRequest:
  """The full request a wire message stands for (the server's side of :func:`encode_request`).

  Raises :class:`wire.ResumeBaseMissingError` when this end holds no identical base.
  """
  if isinstance(msg, api.RolloutRequest):
    return msg
  req = msg.request
  base = contexts.get(req.hold) if req.hold else None
  if base is None or len(base.tokens) != msg.base_tokens or base.crc != msg.base_crc:
    why = ("no base" if base is None else
           f"base of {len(base.tokens)} tokens, crc {base.crc:#010x}")
    raise wire.ResumeBaseMissingError(
        f"request {req.request_id}: hold {req.hold!r} sent as a delta on {msg.base_tokens}"
        f" tokens (crc {msg.base_crc:#010x}); this server has {why}: send it in full",
        (req.request_id,))
  tail = api.ResumeParts.of(req)
  routing = None
  if base.routing is not None:
    if req.resume_routing is None:
      raise ValueError(f"request {req.request_id}: delta without routes on a base with routes")
    routing = np.concatenate([base.routing, req.resume_routing])
  return dataclasses.replace(
      req, prompt_tokens=base.prompt_tokens,
      resume_tokens=np.concatenate([base.tokens, tail.tokens]),
      resume_logprobs=np.concatenate([base.logprobs, tail.logprobs]), resume_routing=routing)


def strip_result(request: api.RolloutRequest, result: api.RolloutResult
                 ) -> api.RolloutResult | wire.ResultDelta:
  """``result`` less the prefix ``request`` (the full one) carried, when there is one."""
  if request.resume_tokens is None or not len(request.resume_tokens):
    return result
  resume = api.ResumeParts.of(request)
  n = len(resume.tokens)
  if not (_starts_with(np.asarray(result.completion_tokens), resume.tokens, n)
          and _starts_with(np.asarray(result.logprobs), resume.logprobs, n)):
    return result
  rows = 0
  routing = result.routing
  if routing is not None and resume.routing is not None:
    # Only rows the request sent that came back unchanged: the prefill fills rows it lacked
    # (then every row goes back; routes are small beside a long context's tokens).
    rows = len(request.prompt_tokens) + n
    if not _starts_with(np.asarray(routing), resume.routing, rows):
      rows = 0
    routing = routing[rows:]
  return wire.ResultDelta(
      dataclasses.replace(result, completion_tokens=result.completion_tokens[n:],
                          logprobs=result.logprobs[n:], routing=routing), n, rows)


def restore_result(request: api.RolloutRequest, msg: api.RolloutResult | wire.ResultDelta
                   ) -> api.RolloutResult:
  """The whole result (the client's side of :func:`strip_result`; ``request`` is the full
  request this client was given)."""
  if isinstance(msg, api.RolloutResult):
    return msg
  resume = api.ResumeParts.of(request)
  res = msg.result
  if msg.offset > len(resume) or (msg.routing_offset and (
      resume.routing is None or msg.routing_offset > len(resume.routing))):
    raise wire.WireFormatError(
        f"result of {request.request_id} starts at {msg.offset} (routes {msg.routing_offset})"
        f" past the {len(resume)} tokens the request carried")
  routing = res.routing
  if msg.routing_offset:
    routing = np.concatenate([resume.routing[:msg.routing_offset], res.routing])
  return dataclasses.replace(
      res, completion_tokens=np.concatenate([resume.tokens[:msg.offset], res.completion_tokens]),
      logprobs=np.concatenate([resume.logprobs[:msg.offset], res.logprobs]), routing=routing)
