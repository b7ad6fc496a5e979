"""Host-side records that cross module boundaries.

They live in one module so that the data pipeline, rollout servers, orchestrator
and learner agree on a single definition of a prompt and a trajectory; the
integrity checks (every sample trained once, groups complete) key on
``(sample_id, member)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One task instance. ``sample_id`` identifies the GRPO group it spawns."""

  sample_id: int
  task: str
  text: str
  answer: str
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TokenSpan:
  """Completion tokens ``[start, end)`` were sampled by policy ``version``."""

  start: int
  end: int
  version: int


def no_route(dtype: Any) -> int:
  """The "no route recorded" sentinel of an MoE routing record of ``dtype`` (its maximum;
  ``jax_dora.model.routing`` says where it appears). Here, in the leaf module, so that every
  reader of records (batches, tool turns, the audit) spells it one way."""
  return int(np.iinfo(np.dtype(dtype)).max)


@dataclasses.dataclass
class Trajectory:
  """A completed (or aborted) generation with everything the learner needs.

  ``behaviour_logprobs`` are the log-probs under the policy that actually
  sampled each token, so the learner's importance ratios stay correct when the
  trajectory is consumed off-policy.
  """

  sample_id: int
  member: int
  prompt: Prompt
  prompt_tokens: np.ndarray
  completion_tokens: np.ndarray
  behaviour_logprobs: np.ndarray
  spans: list[TokenSpan]
  finish_reason: str  # "eos" | "length" | "aborted"
  reward: float | None = None
  # Part of ``reward`` added by shaping (DAPO's overlong penalty), not the verifier.
  reward_shaping: float = 0.0
  start_version: int = -1
  finish_version: int = -1
  consumed_version: int = -1
  submit_time: float = 0.0
  finish_time: float = 0.0
  # Run incarnation of the policy versions that generated it (see
  # jax_dora.snapshots): version numbers are only comparable within one.
  incarnation: str = ""
  # Multi-turn (tool calls): completion ranges [start, end) the policy did not
  # sample but the orchestrator appended (tool observations, with their fixed
  # wrapper text). Context for the learner: loss mask 0, behaviour log-prob 0,
  # covered by no span, and not counted in any "sampled tokens" figure.
  context_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  # One record per tool call, in order (``jax_dora.tools.ToolTurn.to_record``):
  # the call's text, the observation, its status and where it sits.
  tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  # MoE: ``[len(prompt) + len(completion), moe_layers, k]`` the experts the
  # rollout routed each token to (``jax_dora.model.routing``; the sentinel
  # where none was recorded); None from a dense model. What
  # ``learner.moe_routing=replay`` trains with.
  routing: np.ndarray | None = None

  @property
  def key(self) -> tuple[int, int]:
    return (self.sample_id, self.member)

  @property
  def num_completion_tokens(self) -> int:
    return int(len(self.completion_tokens))

  @property
  def num_sampled_tokens(self) -> int:
    """Completion tokens the policy sampled (observations excluded)."""
    return self.num_completion_tokens - sum(e - s for s, e in self.context_spans)

  def sampled_mask(self) -> np.ndarray:
    """``[num_completion_tokens]`` bool: True where the policy sampled the token."""
    out = np.ones((self.num_completion_tokens,), bool)
    for s, e in self.context_spans:
      out[s:e] = False
    return out

  @property
  def behaviour_versions(self) -> list[int]:
    return sorted({s.version for s in self.spans})

  @property
  def oldest_version(self) -> int:
    return min(s.version for s in self.spans) if self.spans else self.start_version

  def unrouted_positions(self) -> int:
    """Positions the trained tokens condition on (up to the last sampled one) that
    have no recorded route: 0 for a complete record (the audit's check)."""
    if self.routing is None:
      return 0
    sampled = np.flatnonzero(self.sampled_mask())
    if not sampled.size:
      return 0
    needed = len(self.prompt_tokens) + int(sampled[-1])
    head = self.routing[:needed]
    return int(np.sum(np.any(head == no_route(head.dtype), axis=(-2, -1))))

  def token_versions(self) -> np.ndarray:
    """Per-completion-token policy version, expanded from ``spans``."""
    out = np.full((self.num_completion_tokens,), -1, dtype=np.int32)
    for s in self.spans:
      out[s.start:s.end] = s.version
    return out
