"""Wire format of the ``jax_dora.Rollout`` gRPC service: msgpack, no protoc.

Why msgpack and a generic handler instead of a ``.proto``: the messages are the
dataclasses of :mod:`jax_dora.rollout.api` and nothing else, and they must stay
identical on both transports (embedded and gRPC). Encoding those dataclasses
directly means the contract has one definition, there is no generated code to
keep in sync and no build step on the TPU VMs; gRPC still gives us HTTP/2
streaming, deadlines, cancellation and connection-failure detection.

Encoding rules:

* numpy arrays travel as ``{"__nd__": [dtype, shape, raw bytes]}`` (C order),
  so token ids and float32 log-probs round-trip bit-exactly. Only numeric and
  bool dtypes are accepted on decode; an ``object`` array would otherwise let a
  peer make us unpickle.
* The wire dataclasses (:data:`_TYPES`) travel as ``{"__dc__": name, **fields}``.
  Decoding only ever constructs those types, and converts lists back to tuples
  for tuple-typed fields (msgpack has no tuple), so a decoded object compares
  equal to the one that was sent.
* Errors raised by the driver travel in-band on the ``Generate`` stream as a
  :class:`WireError` frame, so the client can re-raise the same
  :class:`~jax_dora.rollout.api.RolloutError` subclass with the same request
  ids; transport failures are gRPC status codes instead (see ``client.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

from jax_dora.rollout import api
from jax_dora.types import TokenSpan

SERVICE = "jax_dora.Rollout"
# unary-stream: RolloutRequest | ResumeDelta -> RolloutChunk* (RolloutResult | ResultDelta | WireError)
GENERATE = "Generate"
LOAD_VERSION = "LoadVersion"  # unary: {"version": int} -> {"versions_loaded": [...]}
ABORT = "Abort"  # unary: {"request_ids": [...]} -> {}
STATUS = "Status"  # unary: {} -> ServerStatus
HEALTH = "Health"  # unary: {} -> {"live", "name", "versions_loaded", "instance" (uuid per process), "incarnation"}


def method_path(method: str) -> str:
  """Full gRPC path, e.g. ``/jax_dora.Rollout/Generate``."""
  return f"/{SERVICE}/{method}"


@dataclasses.dataclass
class WireError:
  """A driver-side failure of one request, sent as the last stream frame.

  ``kind`` is the exception class name (``RolloutError`` or
  ``VersionUnavailableError``) so the client re-raises the same type.
  """

  kind: str
  message: str
  request_ids: tuple[str, ...] = ()

  @classmethod
  def from_exception(cls, e: BaseException, request_id: str) -> WireError:
    ids = tuple(getattr(e, "failed_request_ids", ())) or (request_id,)
    kind = next((k for k, t in _ERROR_KINDS.items() if isinstance(e, t)), "RolloutError")
    return cls(kind=kind, message=str(e) or type(e).__name__, request_ids=ids)

  def to_exception(self, prefix: str = "") -> api.RolloutError:
    cls = _ERROR_KINDS.get(self.kind, api.RolloutError)
    return cls(prefix + self.message, self.request_ids)


@dataclasses.dataclass
class ResumeDelta:
  """A multi-turn next turn without the context its server already holds (``wire_delta.py``).

  ``request`` is the turn's :class:`~jax_dora.rollout.api.RolloutRequest` with
  an empty ``prompt_tokens`` and ``resume_*`` fields that hold only what
  follows the base: the prompt plus the first ``base_tokens`` completion
  tokens of the hold's last turn, as the server sent them, whose bytes hash to
  ``base_crc`` (CRC32; the server expands only an identical base).
  """

  request: api.RolloutRequest
  base_tokens: int
  base_crc: int


@dataclasses.dataclass
class ResultDelta:
  """A result without the part of it the request carried (``wire_delta.py``).

  ``result.completion_tokens`` / ``logprobs`` start at completion index
  ``offset`` and ``result.routing`` at row ``routing_offset``; the client puts
  back the prefix it sent (the server stripped only a prefix it checked equal).
  """

  result: api.RolloutResult
  offset: int
  routing_offset: int


class ResumeBaseMissingError(api.RolloutError):
  """The server holds no identical base for a :class:`ResumeDelta` (evicted, restarted,
  released): the client sends that request again in full. Never leaves the client."""


# The RolloutError subclasses a client re-raises by name (subclasses first).
_ERROR_KINDS: dict[str, type[api.RolloutError]] = {
    "ResumeBaseMissingError": ResumeBaseMissingError,
    "VersionUnavailableError": api.VersionUnavailableError,
    "IncarnationMismatchError": api.IncarnationMismatchError,
    "RolloutError": api.RolloutError,
}


_TYPES: dict[str, type] = {
    t.__name__: t
    for t in (
        api.RolloutRequest,
        api.RolloutChunk,
        api.RolloutResult,
        api.ServerStatus,
        TokenSpan,
        WireError,
        ResumeDelta,
        ResultDelta,
    )
}
# Fields annotated ``tuple[...]`` (annotations are strings under
# ``from __future__ import annotations``); msgpack hands them back as lists.
_TUPLE_FIELDS: dict[str, frozenset[str]] = {
    name: frozenset(
        f.name for f in dataclasses.fields(t) if str(f.type).startswith("tuple")
    )
    for name, t in _TYPES.items()
}
_ND = "__nd__"
_DC = "__dc__"


class WireFormatError(ValueError):
  """A frame could not be decoded (corrupt, or from an incompatible peer)."""


def _default(obj: Any) -> Any:
  if isinstance(obj, np.ndarray):
    if obj.dtype.kind not in "biuf":
      raise TypeError(f"cannot send array of dtype {obj.dtype} on the wire")
    a = np.ascontiguousarray(obj)
    return {_ND: [a.dtype.str, list(a.shape), a.tobytes()]}
  if isinstance(obj, np.generic):
    return obj.item()
  if dataclasses.is_dataclass(obj) and type(obj).__name__ in _TYPES:
    d = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    d[_DC] = type(obj).__name__
    return d
  raise TypeError(f"cannot send {type(obj).__name__} on the wire")


def _object_hook(d: dict[str, Any]) -> Any:
  if _ND in d:
    dtype_str, shape, raw = d[_ND]
    dtype = np.dtype(dtype_str)
    if dtype.kind not in "biuf":
      raise WireFormatError(f"refusing array of dtype {dtype}")
    # ``frombuffer`` is a read-only view of the message; copy so receivers may
    # write into it (e.g. the driver appending to resume tokens).
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
  if _DC in d:
    name = d.pop(_DC)
    cls = _TYPES.get(name)
    if cls is None:
      raise WireFormatError(f"unknown wire type {name!r}")
    for key in _TUPLE_FIELDS[name]:
      if isinstance(d.get(key), list):
        d[key] = tuple(d[key])
    try:
      return cls(**d)
    except TypeError as e:
      raise WireFormatError(f"bad fields for {name}: {e}") from e
  return d


def dumps(obj: Any) -> bytes:
  """Serialises a wire dataclass, dict, list or scalar (arrays anywhere)."""
  return msgpack.packb(obj, default=_default, use_bin_type=True)


def loads(data: bytes) -> Any:
  """Inverse of :func:`dumps`; raises :class:`WireFormatError` on bad input."""
  try:
    return msgpack.unpackb(
        data, object_hook=_object_hook, raw=False, strict_map_key=False
    )
  except WireFormatError:
    raise
  except Exception as e:  # msgpack raises several unrelated types.
    raise WireFormatError(f"undecodable frame ({len(data)} bytes): {type(e).__name__}: {e}") from e


def loads_as(expected: type | tuple[type, ...]):
  """A deserializer that also checks the decoded type.

  Used as the gRPC ``request_deserializer`` so that a handler never sees, for
  instance, a dict where it expects a :class:`RolloutRequest`.
  """

  def _loads(data: bytes) -> Any:
    obj = loads(data)
    if not isinstance(obj, expected):
      raise WireFormatError(
          f"expected {expected}, got {type(obj).__name__}"
      )
    return obj

  return _loads
