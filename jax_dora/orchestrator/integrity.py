"""An audit trail proving every sample was trained exactly once, fresh enough.

Asynchronous RL has many ways to lose or duplicate data silently: a server
dies mid-rollout, a group is rejected, a run is killed and resumed, a race
hands one trajectory to the learner twice. A bug there does not crash; it just
biases training. The :class:`IntegrityLedger` therefore records every event in
a sample's life and :meth:`IntegrityLedger.check` turns the DORA constraints
into a list of human-readable violations (empty = all good):

* data integrity: every ``(sample_id, member)`` trained at most once; every
  trained GRPO group complete (members ``0..G-1``, one learner step); every
  issued key accounted for at the end (trained, dropped with a reason, or
  carried to the next run as pending); nothing trained that was not issued
  and finished in this run, and nothing trained that was dropped;
* bounded staleness: ``learner_version - oldest span version <= max_staleness``
  at training time, and no span from a version newer than the learner's;
* intra-trajectory consistency: one policy version per trajectory unless the
  mode resumes interrupted rollouts (``allow_multi_version``); spans cover the
  completion exactly.

Events are appended to a JSONL file (the "trained-sample log", one object per
line with an ``"event"`` field) as they happen, so the checks can be re-run
from the file alone (:meth:`IntegrityLedger.from_log`) after the process is
gone. A resumed run truncates the log to what its checkpoint had already
trained and keeps those records ("carried"), so a sample trained before the
checkpoint and again after the resume is still caught.

The log may be a local file or a ``gs://``-style URI. A remote log is rewritten
whole on each (throttled) flush, never between the records of one learner
step (see :class:`jax_dora.metrics.jsonl.JsonlAppender`); call
:meth:`IntegrityLedger.flush` before saving a checkpoint.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from jax_dora.metrics.jsonl import (REMOTE_FLUSH_INTERVAL_S, JsonlAppender, PathLike, as_path,
                                    read_jsonl)
from jax_dora.types import Trajectory

log = logging.getLogger(__name__)

Key = tuple[int, int]

# Per-key states within the current run.
ISSUED = "issued"
FINISHED = "finished"
AWAITING_REGENERATION = "awaiting_regeneration"
TRAINED = "trained"
DROPPED = "dropped"
PENDING = "pending"
_OPEN = (ISSUED, FINISHED, AWAITING_REGENERATION)


def read_log(path: PathLike) -> list[dict[str, Any]]:
  """Reads a trained-sample log; a torn last line (killed writer) is skipped."""
  return read_jsonl(path)


def _spans_json(traj: Trajectory) -> list[list[int]]:
  return [[int(s.start), int(s.end), int(s.version)] for s in traj.spans]


class IntegrityLedger:
  """Records sample events, writes them to JSONL, and checks the invariants."""

  def __init__(
      self,
      path: PathLike | None = None,
      *,
      group_size: int,
      max_staleness: int,
      allow_multi_version: bool = False,
      truncate_after_step: int | None = 0,
      flush_interval_s: float = REMOTE_FLUSH_INTERVAL_S,
  ):
    """Opens the ledger.

    Args:
      path: JSONL log file, a local path or a URI (``gs://...``); ``None``
        keeps the ledger in memory only.
      group_size: ``G``; a trained group must contain members ``0..G-1``.
      max_staleness: the hard bound checked on every trained record.
      allow_multi_version: True for modes that resume interrupted rollouts on
        a newer version (``partial_rollout``, ``async_unfiltered``).
      truncate_after_step: for an existing log, keep only what a checkpoint at
        this step had already made final (``trained`` records with ``step <=
        N`` and drops recorded before step ``N``), discard everything else and
        start a new run. 0 starts fresh. ``None`` appends to the log as is
        (everything in it becomes carried history).
      flush_interval_s: for a URI, least seconds between two uploads of the
        log (each rewrites the whole object); :meth:`flush` and :meth:`close`
        always upload.
    """
    self.group_size = int(group_size)
    self.max_staleness = int(max_staleness)
    self.allow_multi_version = bool(allow_multi_version)
    self.path = None if path is None else os.fspath(path)
    self._lock = threading.RLock()
    self._reset_state()
    self._out: JsonlAppender | None = None
    resumed_from = 0 if truncate_after_step is None else int(truncate_after_step)
    history: list[dict[str, Any]] = []
    if self.path is not None:
      keep = None
      if as_path(path).exists():
        history = read_log(path)
        if truncate_after_step is not None:
          history = keep = self._final_before(history, int(truncate_after_step))
      self._out = JsonlAppender(path, keep=keep, flush_interval_s=flush_interval_s)
    for r in history:
      self._apply(r, carried=True)
    trained_steps = [int(r["step"]) for r in history if r["event"] == "trained"]
    self._step = max([resumed_from, *trained_steps])
    self._emit({"event": "run_start", "resumed_from_step": resumed_from, "time": time.time()})

  @staticmethod
  def _final_before(records: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """Records a checkpoint at ``step`` had made final.

    A drop recorded at step ``s`` happened after training step ``s``; only if
    ``s < step`` did the checkpoint (taken right after training ``step``)
    know about it. Later drops were still outstanding in the checkpoint and
    are re-issued by the resumed run.
    """
    keep = []
    for r in records:
      if r["event"] == "trained" and int(r["step"]) <= step:
        keep.append(r)
      elif r["event"] == "rejected" and not r["regenerate"] and int(r["step"]) < step:
        keep.append(r)
    return keep

  def _reset_state(self) -> None:
    self._state: dict[Key, str] = {}
    self._members: dict[int, set[int]] = collections.defaultdict(set)
    self._trained: list[dict[str, Any]] = []  # carried + current, with "carried" flag
    self._dropped: set[Key] = set()
    self._event_violations: list[str] = []
    self._reported: set[tuple[str, Key]] = set()
    self._reasons: collections.Counter[str] = collections.Counter()
    self._counts: collections.Counter[str] = collections.Counter()
    self._step = 0

  @classmethod
  def from_log(
      cls,
      path: PathLike,
      *,
      group_size: int,
      max_staleness: int,
      allow_multi_version: bool = False,
  ) -> IntegrityLedger:
    """Rebuilds a read-only ledger from a log file, for auditing after the fact.

    Records before the last ``run_start`` are carried history; the rest is the
    run whose accounting :meth:`check` verifies.
    """
    records = read_log(path)
    starts = [i for i, r in enumerate(records) if r["event"] == "run_start"]
    split = starts[-1] if starts else 0
    led = cls(None, group_size=group_size, max_staleness=max_staleness,
              allow_multi_version=allow_multi_version)
    led._reset_state()  # drop the run_start the constructor emitted
    for i, r in enumerate(records):
      led._apply(r, carried=i < split)
    return led

  # -------------------------------------------------------------- recording
  def _emit(self, *recs: dict[str, Any]) -> None:
    """Logs and applies ``recs`` as one batch (a remote log never splits it)."""
    with self._lock:
      for rec in recs:
        rec.setdefault("step", self._step)
      if self._out is not None:
        self._out.append(json.dumps(rec) for rec in recs)
      for rec in recs:
        self._apply(rec, carried=False)

  def _violation(self, kind: str, key: Key, msg: str) -> None:
    if (kind, key) not in self._reported:
      self._reported.add((kind, key))
      self._event_violations.append(msg)

  def _check_spans(self, key: Key, spans: list[list[int]], num_tokens: int) -> None:
    pos = 0
    for s, e, _ in sorted(spans):
      if s != pos or e < s:
        break
      pos = e
    else:
      if pos == num_tokens:
        if not self.allow_multi_version and len({v for _, _, v in spans}) > 1:
          self._violation(
              "multi", key,
              f"{key}: generated by versions {sorted({v for _, _, v in spans})} but this mode"
              " never resumes rollouts (intra-trajectory consistency)",
          )
        return
    self._violation("spans", key, f"{key}: spans {spans} do not cover its {num_tokens} tokens")

  def _apply(self, r: dict[str, Any], carried: bool) -> None:
    ev = r["event"]
    self._counts[ev] += 1
    if ev == "run_start":
      return
    sid = int(r["sample_id"])
    if carried:
      # Earlier runs: only what was made final matters here.
      if ev == "trained":
        key = (sid, int(r["member"]))
        self._trained.append(dict(r, carried=True))
        self._check_spans(key, r["spans"], int(r["num_tokens"]))
      elif ev == "rejected" and not r["regenerate"]:
        self._dropped.update((sid, int(m)) for m in r["members"])
      return
    if ev == "pending":
      for m in self._members.get(sid, ()):
        if self._state.get((sid, m)) in _OPEN:
          self._state[(sid, m)] = PENDING
      return
    if ev == "rejected":
      self._reasons[r["reason"]] += 1
      for m in r["members"]:
        key = (sid, int(m))
        if self._state.get(key) != FINISHED:
          self._violation(
              "reject", key, f"{key}: rejected ({r['reason']}) in state {self._state.get(key)}"
          )
        if r["regenerate"]:
          self._state[key] = AWAITING_REGENERATION
        else:
          self._state[key] = DROPPED
          self._dropped.add(key)
      return
    key = (sid, int(r["member"]))
    self._members[sid].add(key[1])
    state = self._state.get(key)
    if ev == "issued":
      self._state[key] = ISSUED
    elif ev == "reissued":
      if state != ISSUED:
        self._violation("reissue", key, f"{key}: re-issued after server failure in state {state}")
      self._state[key] = ISSUED
    elif ev == "finished":
      if state != ISSUED:
        self._violation("finish", key, f"{key}: finished in state {state} (never issued?)")
      self._state[key] = FINISHED
      self._check_spans(key, r["spans"], int(r["num_tokens"]))
    elif ev == "trained":
      if key in self._dropped:
        self._violation("dropped", key, f"{key}: trained although it was dropped")
      elif state != FINISHED:
        self._violation(
            "train", key,
            f"{key}: trained in state {state} (not issued and finished in this run)",
        )
      self._state[key] = TRAINED
      self._trained.append(dict(r, carried=False))
    else:
      raise ValueError(f"unknown ledger event {ev!r}")

  def issued(self, sample_id: int, member: int, version: int) -> None:
    """A rollout request for the key was sent (``version``: newest at that time)."""
    self._emit({"event": "issued", "sample_id": int(sample_id), "member": int(member),
                "version": int(version)})

  def reissued(self, sample_id: int, member: int, why: str) -> None:
    """The request was re-sent to another server after its server failed."""
    self._emit({"event": "reissued", "sample_id": int(sample_id), "member": int(member),
                "why": str(why)})

  def finished(self, traj: Trajectory) -> None:
    """A complete (not aborted) trajectory came back for the key."""
    self._emit({
        "event": "finished", "sample_id": int(traj.sample_id), "member": int(traj.member),
        "spans": _spans_json(traj), "num_tokens": traj.num_completion_tokens,
        "finish_reason": traj.finish_reason, "start_version": int(traj.start_version),
        "finish_version": int(traj.finish_version),
    })

  def trained(self, trajs: Iterable[Trajectory], *, learner_version: int, step: int) -> None:
    """The trajectories were consumed by learner step ``step`` at ``learner_version``."""
    with self._lock:
      self._step = int(step)
      self._emit(*({
          "event": "trained", "sample_id": int(t.sample_id), "member": int(t.member),
          "spans": _spans_json(t), "num_tokens": t.num_completion_tokens,
          "learner_version": int(learner_version), "step": int(step),
          "start_version": int(t.start_version), "finish_version": int(t.finish_version),
          "reward": None if t.reward is None else float(t.reward),
      } for t in trajs))

  def rejected(self, group: Sequence[Trajectory], reason: str, *, regenerate: bool,
               version: int | None = None) -> None:
    """A finished group was rejected (``"stale"``, ``"pace"``, ...).

    ``regenerate=True`` means its prompt was re-queued, so its keys must be
    issued again (or carried as pending) before the run ends; ``False`` means
    it was dropped for good and must never be trained.
    """
    if not group:
      return
    sids = {t.sample_id for t in group}
    if len(sids) != 1:
      raise ValueError(f"a rejected group must hold one sample id, got {sorted(sids)}")
    self._emit({
        "event": "rejected", "sample_id": int(group[0].sample_id),
        "members": sorted(int(t.member) for t in group), "reason": str(reason),
        "regenerate": bool(regenerate), "version": None if version is None else int(version),
    })

  def pending(self, sample_id: int) -> None:
    """The sample is carried, un-trained, into the next run's checkpoint."""
    self._emit({"event": "pending", "sample_id": int(sample_id)})

  # ---------------------------------------------------------------- queries
  def count(self, reason: str) -> int:
    """Groups rejected with ``reason`` in this run."""
    return self._reasons[reason]

  def summary(self) -> dict[str, Any]:
    """Event counts and rejection reasons, for the run summary."""
    with self._lock:
      return {**{f"events/{k}": v for k, v in sorted(self._counts.items())},
              **{f"rejected/{k}": v for k, v in sorted(self._reasons.items())}}

  def trained_records(self) -> list[dict[str, Any]]:
    with self._lock:
      return [dict(r) for r in self._trained]

  def check(self, final: bool = True) -> list[str]:
    """Returns every invariant violation found (empty list = all good).

    Args:
      final: also require every issued key of this run to be accounted for
        (trained, dropped or pending); pass False mid-run.
    """
    with self._lock:
      out = list(self._event_violations)
      times = collections.Counter((int(r["sample_id"]), int(r["member"])) for r in self._trained)
      out += [f"{k}: trained {n} times" for k, n in sorted(times.items()) if n > 1]
      by_sample: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
      for r in self._trained:
        by_sample[int(r["sample_id"])].append(r)
        key = (int(r["sample_id"]), int(r["member"]))
        lv = int(r["learner_version"])
        versions = [v for _, _, v in r["spans"]] or [int(r["start_version"])]
        bs = lv - min(versions)
        if bs > self.max_staleness:
          out.append(f"{key}: behaviour staleness {bs} > max_staleness {self.max_staleness}"
                     f" (learner version {lv}, spans {r['spans']})")
        if max(versions) > lv:
          out.append(f"{key}: span from version {max(versions)} newer than learner version {lv}")
      want = set(range(self.group_size))
      for sid, recs in sorted(by_sample.items()):
        members = {int(r["member"]) for r in recs}
        if members != want:
          out.append(f"group {sid}: trained members {sorted(members)},"
                     f" expected 0..{self.group_size - 1}")
        steps = sorted({int(r["step"]) for r in recs})
        if len(steps) > 1:
          out.append(f"group {sid}: split across learner steps {steps}")
      if final:
        open_keys = sorted(k for k, s in self._state.items() if s in _OPEN)
        out += [f"{k}: issued but never accounted for (last state {self._state[k]})"
                for k in open_keys]
      return out

  def flush(self) -> None:
    """Makes every event so far durable (uploads a remote log).

    Call before saving a checkpoint: a run resumed from it then finds every
    record that checkpoint made final in the log.
    """
    with self._lock:
      if self._out is not None:
        self._out.flush()

  def close(self) -> None:
    with self._lock:
      if self._out is not None:
        self._out.close()
        self._out = None

  def __enter__(self) -> IntegrityLedger:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
