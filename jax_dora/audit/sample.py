"""The audit's sample: a random share of the trained trajectories, kept and written down.

The ledger records *what happened* to every sample; the checks that re-derive
the data itself (rewards re-scored, version labels recomputed) need the data:
prompt, token ids, behaviour log-probs, spans. Keeping all of it for every
trajectory would cost as much disk as the rollouts themselves, so
``audit.verify_fraction`` of them are picked (one draw per trajectory, the
run's seed) and appended to ``<output_dir>/audit_sample.jsonl`` as they are
trained. The online checks use the picked trajectories in memory; the offline
``python -m jax_dora.audit RUN_DIR`` reads them back from the file and runs the
same checks after the process is gone (1.0 in a run that must be verifiable
in full).

Log-probs are float32 values written as Python floats (``repr`` round-trips
them exactly); routes, for an MoE policy, as nested lists.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jax_dora.metrics.jsonl import JsonlAppender, PathLike, as_path, read_jsonl
from jax_dora.types import Prompt, TokenSpan, Trajectory

SAMPLE_FILE = "audit_sample.jsonl"


def trajectory_record(t: Trajectory, *, step: int, learner_version: int) -> dict[str, Any]:
  """One JSON object holding everything the checks need to re-derive ``t``'s data."""
  rec = {
      "sample_id": int(t.sample_id), "member": int(t.member),
      "prompt": dataclasses.asdict(t.prompt),
      "prompt_tokens": np.asarray(t.prompt_tokens).tolist(),
      "completion_tokens": np.asarray(t.completion_tokens).tolist(),
      "behaviour_logprobs": [float(x) for x in np.asarray(t.behaviour_logprobs, np.float32)],
      "spans": [[int(s.start), int(s.end), int(s.version)] for s in t.spans],
      "context_spans": [[int(s), int(e)] for s, e in t.context_spans],
      "finish_reason": t.finish_reason,
      "reward": None if t.reward is None else float(t.reward),
      "reward_shaping": float(t.reward_shaping),
      "start_version": int(t.start_version), "finish_version": int(t.finish_version),
      "incarnation": t.incarnation,
      "step": int(step), "learner_version": int(learner_version),
  }
  if t.routing is not None:
    rec["routing"] = np.asarray(t.routing).tolist()
    rec["routing_dtype"] = str(np.asarray(t.routing).dtype)
  return rec


def trajectory_from_record(r: dict[str, Any]) -> Trajectory:
  """The :class:`Trajectory` a :func:`trajectory_record` describes."""
  routing = r.get("routing")
  return Trajectory(
      sample_id=int(r["sample_id"]), member=int(r["member"]), prompt=Prompt(**r["prompt"]),
      prompt_tokens=np.asarray(r["prompt_tokens"], np.int32),
      completion_tokens=np.asarray(r["completion_tokens"], np.int32),
      behaviour_logprobs=np.asarray(r["behaviour_logprobs"], np.float32),
      spans=[TokenSpan(int(s), int(e), int(v)) for s, e, v in r["spans"]],
      finish_reason=r["finish_reason"], reward=r["reward"],
      reward_shaping=float(r.get("reward_shaping", 0.0)),
      start_version=int(r["start_version"]), finish_version=int(r["finish_version"]),
      consumed_version=int(r["learner_version"]), incarnation=r.get("incarnation", ""),
      context_spans=[(int(s), int(e)) for s, e in r.get("context_spans", ())],
      routing=None if routing is None else np.asarray(routing, r.get("routing_dtype", "uint8")),
  )


class AuditSample:
  """Picks ``fraction`` of the trained trajectories and appends them to ``path``."""

  def __init__(self, fraction: float, *, seed: int = 0, path: PathLike | None = None,
               resumed_from_step: int = 0):
    """``resumed_from_step``: an existing file keeps the records of steps up to it (what the
    checkpoint the run resumes from had trained, as the ledger does); 0 starts it over."""
    self.fraction = float(fraction)
    self._rng = random.Random(seed + 1000003 * int(resumed_from_step))
    self._out = None
    if path is not None and self.fraction > 0:
      old = read_jsonl(path) if as_path(path).exists() else []
      self._out = JsonlAppender(
          path, keep=[r for r in old if int(r["step"]) <= int(resumed_from_step)])

  def pick(self, trajs: Sequence[Trajectory], *, step: int,
           learner_version: int) -> list[Trajectory]:
    """The trajectories of one trained batch that the audit re-verifies (written down)."""
    if self.fraction <= 0:
      return []
    picked = [t for t in trajs if self.fraction >= 1 or self._rng.random() < self.fraction]
    if self._out is not None and picked:
      self._out.append(json.dumps(trajectory_record(t, step=step, learner_version=learner_version))
                       for t in picked)
    return picked

  def flush(self) -> None:
    """Makes every record so far durable (before a checkpoint, as the ledger)."""
    if self._out is not None:
      self._out.flush()

  def close(self) -> None:
    if self._out is not None:
      self._out.close()


def read_sample(path: PathLike) -> list[Trajectory]:
  """Every trajectory an :class:`AuditSample` wrote to ``path`` (none if it does not exist)."""
  if not as_path(path).exists():
    return []
  return [trajectory_from_record(r) for r in read_jsonl(path)]


def subsample(trajs: Iterable[Trajectory], fraction: float, seed: int = 0) -> list[Trajectory]:
  """A ``fraction`` of ``trajs`` (all for 1.0), the same ones for the same seed."""
  rng = random.Random(seed)
  return [t for t in trajs if fraction >= 1 or rng.random() < fraction]
