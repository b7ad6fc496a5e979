"""Fakes behind the orchestrator's protocols, for mode-strategy tests in milliseconds.

The end-to-end tests run the real learner, real engines and real Orbax
snapshots (seconds to minutes each); these stand-ins let a test drive the
*real* :class:`~jax_dora.orchestrator.runner.Orchestrator`, its mode strategy,
the real :class:`~jax_dora.orchestrator.dispatch.Dispatcher` and the real
:class:`~jax_dora.orchestrator.integrity.IntegrityLedger` in well under a
second, with every rollout's length and every server event under the test's
control. Each fake implements one protocol the orchestrator declares
(``jax_dora.orchestrator.host`` and ``jax_dora.rollout.api.RolloutClient``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

import numpy as np

from jax_dora.rollout.api import (
  RolloutChunk,
  RolloutRequest,
  RolloutResult,
  ServerStatus,
  VersionUnavailableError,
)
from jax_dora.types import Prompt, TokenSpan

EOS = 2  # CharTokenizer's EOS id
TOKEN = 10  # what the fake server samples (a printable character)


@dataclasses.dataclass
class SnapshotBoard:
  """The versions a :class:`FakePublisher` wrote: what fake servers may load."""

  published: list[int] = dataclasses.field(default_factory=list)


class FakePublisher:
  """``PublisherLike``: records versions instead of writing Orbax snapshots."""

  def __init__(self, board: SnapshotBoard, write_s: float = 0.0):
    self.board = board
    self.write_s = write_s

  def publish(self, version: int, params: Any, metadata: dict[str, Any],
              owned: bool = False) -> None:
    del params, metadata, owned
    if self.write_s:
      time.sleep(self.write_s)
    self.board.published.append(int(version))


class FakeLearner:
  """``TrainerLike``: counts steps and keeps every batch it was given."""

  def __init__(self, step_s: float = 0.0):
    self._step = 0
    self.step_s = step_s
    self.batches: list[dict[str, np.ndarray]] = []
    self.routing = None  # a dense policy: no recorded MoE routes in its batches

  @property
  def step(self) -> int:
    return self._step

  @property
  def params(self) -> dict[str, int]:
    return {"version": self._step}

  def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    if self.step_s:
      time.sleep(self.step_s)
    self.batches.append(batch)
    self._step += 1
    return {"loss": 0.0}

  def detached_params(self, version: int | None = None, dtype: str | None = None
                      ) -> dict[str, int]:
    del version, dtype
    return dict(self.params)


class FakeScorer:
  """``ScorerLike``: reward = share of the completion's characters that are 'x'.

  The fake server's completions differ in length only, so rewards differ
  within a group (GRPO advantages are not all zero) without any verifier.
  """

  async def score(self, prompt: Prompt, completion: str) -> float:
    del prompt
    return 1.0 / (1.0 + len(completion))

  def metrics(self) -> dict[str, Any]:
    return {}

  def close(self) -> None:
    pass


class CountingPrompts:
  """A prompt source: prompt ``i`` has sample id ``i`` (``next_prompt``/``get_state``)."""

  def __init__(self):
    self.next_sample_id = 0

  def next_prompt(self) -> Prompt:
    i = self.next_sample_id
    self.next_sample_id += 1
    return Prompt(sample_id=i, task="fake", text=f"q{i}", answer="x")

  def get_state(self) -> dict[str, int]:
    return {"next_sample_id": self.next_sample_id}


class ListMetrics:
  """``metrics.write(record)`` into a list."""

  def __init__(self):
    self.records: list[dict[str, Any]] = []

  def write(self, rec: dict[str, Any]) -> None:
    self.records.append(rec)


def tail_length(sample_id: int, member: int, max_new_tokens: int, seed: int = 0) -> int:
  """A long-tailed rollout length, fixed by (sample, member): most are short, a few long."""
  u = random.Random(seed * 1_000_003 + sample_id * 1009 + member).random()
  return max(1, min(max_new_tokens, int(2.0 / (1.0 - u) ** 0.9)))


class FakeRolloutServer:
  """``RolloutClient``: a multi-version server that sleeps ``tick_s`` per token.

  Keeps the contract the real engine keeps and the modes rely on: a request
  pinned to a version (or, unpinned, to the newest loaded one) generates every
  token with it; a loaded version stays while a request uses it; aborted
  requests return their partial completion with its spans; a resumed one
  continues on the newest version. Rollout ``(sample, member)`` is always
  ``tail_length(...)`` tokens long (EOS last) unless ``max_new_tokens`` cuts it.
  """

  def __init__(self, name: str, board: SnapshotBoard, *, slots: int = 8, tick_s: float = 2e-4,
               load_s: float = 2e-3, seed: int = 0, script: Any = None):
    self.name = name
    self.board = board
    self.slots = slots
    self.tick_s = tick_s
    self.load_s = load_s  # a snapshot load takes time, as an Orbax restore does
    # Multi-turn: ``script(sample_id, member, text so far) -> text to generate``
    # (CharTokenizer characters; EOS follows unless a stop string ends the turn).
    self.script = script
    # hold id -> the version it pins (RolloutRequest.hold; None: keep_version=False)
    self.holds: dict[str, int | None] = {}
    self.hold_takeovers = 0
    self.seed = seed
    self.loaded: set[int] = set()
    self.newest: int | None = None
    self.incarnation = ""
    self.active: dict[str, int] = {}  # request id -> its version
    self._aborted: set[str] = set()
    self._free = asyncio.Semaphore(slots)
    self.generated = 0
    self.aborts = 0  # requests this server was asked to abort while running
    self.max_live_versions = 0  # most versions in use by running requests at once

  async def load_version(self, version: int, incarnation: str | None = None) -> None:
    if version not in self.board.published:
      raise VersionUnavailableError(f"{self.name}: version {version} was never published")
    if version in self.loaded:
      return
    await asyncio.sleep(self.load_s)
    if incarnation is not None:
      self.incarnation = incarnation
    self.loaded.add(int(version))
    self.newest = max(self.loaded)
    self._retire_unused()

  def _retire_unused(self) -> None:
    in_use = set(self.active.values()) | {v for v in self.holds.values() if v is not None}
    self.loaded = {v for v in self.loaded if v == self.newest or v in in_use}

  async def generate(self, req: RolloutRequest) -> RolloutResult:
    held = self.holds.get(req.hold) if req.hold else None
    version = req.version if req.version is not None else (
        held if held is not None else self.newest)
    if version is None or version not in self.loaded:
      raise VersionUnavailableError(f"{self.name}: version {version} is not loaded")
    if req.hold in self.holds:
      del self.holds[req.hold]  # this turn's own pin (self.active) takes over
      self.hold_takeovers += 1
    _, sample_id, member, _ = req.request_id.rsplit("-", 3)
    tokens = [] if req.resume_tokens is None else [int(t) for t in req.resume_tokens]
    if self.script is None:
      planned = None
      length = tail_length(int(sample_id), int(member), 1 << 20, self.seed)
    else:
      from jax_dora.model.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top

      tok = CharTokenizer()
      text = self.script(int(sample_id), int(member), tok.decode(tokens))
      planned = [int(t) for t in tok.encode_ids(text)] + [EOS]
      length = len(tokens) + len(planned)
      turn_text = ""
    logprobs = [] if req.resume_logprobs is None else [float(x) for x in req.resume_logprobs]
    spans = list(req.resume_spans)
    start = len(tokens)
    self.active[req.request_id] = version
    self.max_live_versions = max(self.max_live_versions, len(set(self.active.values())))
    finish = "eos"
    try:
      async with self._free:
        while True:
          if req.request_id in self._aborted:
            finish = "aborted"
            break
          if len(tokens) >= length:
            break
          if len(tokens) >= req.max_new_tokens:  # the whole completion's budget, as the driver's
            finish = "length"
            break
          await asyncio.sleep(self.tick_s)
          if planned is None:
            tokens.append(EOS if len(tokens) + 1 == length else TOKEN)
          else:
            tokens.append(planned[len(tokens) - start])
          logprobs.append(-0.5)
          self.generated += 1
          if planned is not None and tokens[-1] != EOS:
            turn_text += tok.decode([tokens[-1]])
            if any(turn_text.endswith(x) for x in req.stop_strings):
              finish = "stop"
              break
    finally:
      del self.active[req.request_id]
      self._aborted.discard(req.request_id)
      if req.hold:
        self.holds[req.hold] = version if req.keep_version else None
      self._retire_unused()
    if len(tokens) > start:
      spans.append(TokenSpan(start, len(tokens), version))
    return RolloutResult(req.request_id, np.asarray(tokens, np.int32),
                         np.asarray(logprobs, np.float32), tuple(spans), finish,
                         prefill_version=version, incarnation=req.incarnation)

  async def stream(self, req: RolloutRequest):
    result = await self.generate(req)
    yield RolloutChunk(req.request_id, result.completion_tokens, result.logprobs,
                       result.prefill_version)
    yield result

  async def abort(self, request_ids: list[str]) -> None:
    for rid in request_ids:
      if self.holds.pop(rid, None) is not None:
        self._retire_unused()
      if rid in self.active:
        self.aborts += 1
        self._aborted.add(rid)

  async def status(self) -> ServerStatus:
    return ServerStatus(
        versions_loaded=tuple(sorted(self.loaded)), newest_version=self.newest,
        active_slots=min(len(self.active), self.slots), total_slots=self.slots,
        queued_requests=max(0, len(self.active) - self.slots),
        slot_versions=tuple(self.active.values()), generated_tokens=self.generated,
        busy_time_s=0.0, incarnation=self.incarnation)

  async def close(self) -> None:
    pass
