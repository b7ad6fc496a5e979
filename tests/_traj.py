"""Builders for host-side test trajectories (real dataclasses, no mocks)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_dora.types import Prompt, TokenSpan, Trajectory


def make_traj(
    sample_id: int,
    member: int,
    *,
    length: int = 4,
    spans: Sequence[tuple[int, int, int]] | None = None,
    version: int = 0,
    finish_version: int | None = None,
    finish_reason: str = "eos",
    reward: float = 0.0,
) -> Trajectory:
  """A trajectory of ``length`` tokens; one span at ``version`` unless ``spans`` given."""
  if spans is None:
    spans = [(0, length, version)]
  length = spans[-1][1] if spans else 0
  token_spans = [TokenSpan(s, e, v) for s, e, v in spans]
  start = min(v for _, _, v in spans) if spans else version
  return Trajectory(
      sample_id=sample_id,
      member=member,
      prompt=Prompt(sample_id, "repeat", f"p{sample_id}", "a"),
      prompt_tokens=np.array([1, 5, 6], np.int32),
      completion_tokens=np.full((length,), 7, np.int32),
      behaviour_logprobs=np.zeros((length,), np.float32),
      spans=token_spans,
      finish_reason=finish_reason,
      reward=reward,
      start_version=start,
      finish_version=start if finish_version is None else finish_version,
  )


def make_group(sample_id: int, group_size: int, **kw) -> list[Trajectory]:
  return [make_traj(sample_id, m, **kw) for m in range(group_size)]
