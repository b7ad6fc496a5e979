"""The audit's version-label check: behaviour log-probs recomputed under the claimed version.

Every sampled token carries the policy version that generated it (the
trajectory's spans). The learner trusts the label: the staleness bound, the
importance ratios and the decoupled loss's proximal policy all depend on it.
A wrong label (a span attributed to the next version, a resumed rollout
whose prefix kept the new version's number, a server that loaded one
version and reported another) trains on wrong ratios while the ledger, which
only sees the labels, stays clean. The label is checked the only way that
does not trust it: recompute the span's log-probs under the snapshot of the
version it claims and compare them with the log-probs the server stored.

Where it runs: on the learner's devices, between steps, through the
training forward (``Learner.logprobs_under``: whole sequences, no KV cache,
the same jitted program the decoupled loss uses for its proximal policy).
Each call restores *one* claimed version from its snapshot onto the
learner's shardings (one extra copy of the parameters for the duration: no
optimizer state) and checks every pending span of that version at once;
versions are taken oldest first, so the one nearest retirement goes first
and the backlog never grows past the staleness window (one version is
published per step, one is checked or skipped per step). The restore grows
with the model, so the orchestrator skips a version (counted) whenever the
check's total time would pass ``audit.label_time_share`` of the run's
wall-clock. A version already retired
(``snapshots.max_to_keep`` below the staleness window) cannot be checked:
its spans are counted as unverifiable, never silently passed. The last
versions are drained at the end of the run.

The statistic per (trajectory, claimed version) is the mean absolute
difference of the stored and recomputed log-probs over the span's sampled
tokens; above ``audit.label_tolerance`` it is a violation naming the sample,
the span, the claimed version and the difference. What separates a right
label from a wrong one is measured by ``benchmarks/label_audit.py`` (the
statistic under the claimed version and under the adjacent ones, float32 and
bfloat16 servers): see ``docs/DESIGN.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jax_dora.config import RunConfig
from jax_dora.learner.batching import bucket_length, make_batch
from jax_dora.snapshots import (SnapshotCorruptError, SnapshotIntegrityError,
                                SnapshotNotFoundError, SnapshotReader, as_reader)
from jax_dora.types import Trajectory, no_route

log = logging.getLogger(__name__)

VERSION_LABELS = "version_labels"
SNAPSHOTS = "snapshots"


@dataclasses.dataclass(frozen=True)
class SpanCheck:
  """One trajectory's tokens labelled ``version``, recomputed under that version."""

  key: tuple[int, int]
  version: int
  spans: tuple[tuple[int, int], ...]  # [start, end) completion ranges labelled ``version``
  tokens: int
  mean_abs: float
  max_abs: float


# Rows per recompute call (rounded up to the learner's batch devices): a sample of 2%
# brings one to a few trajectories per version.
_CHUNK_ROWS = 8


def chunk_rows(batch_devices: int, max_rows: int) -> int:
  """Rows of every recompute call: one fixed count, so a run meets one program per length
  bucket, which the learner compiles with its step before the clock starts
  (``Learner.compile_logprobs``) instead of in the middle of a step."""
  unit = int(batch_devices)
  want = max(1, min(int(max_rows), _CHUNK_ROWS))
  return -(-want // unit) * unit


def recompute(learner: Any, params: Any, trajs: Sequence[Trajectory], version: int, *,
              seq_buckets: Sequence[int], pad_id: int, max_rows: int) -> list[SpanCheck]:
  """The log-probs of every token of ``trajs`` labelled ``version``, under ``params``,
  against the stored ones (one :class:`SpanCheck` per trajectory), in calls of
  :func:`chunk_rows` rows."""
  rows = chunk_rows(learner.batch_devices, max_rows)
  out = []
  for lo in range(0, len(trajs), rows):
    chunk = list(trajs[lo:lo + rows])
    seq_len = bucket_length(chunk, seq_buckets)
    # learner_version 0: token_staleness is minus each token's version label.
    batch = make_batch(chunk, np.zeros(len(chunk), np.float32), seq_len, pad_id,
                       learner_version=0, routing=learner.routing)
    batch = _pad_rows(batch, rows)
    logp = learner.logprobs_under(params, batch)[:len(chunk)]
    labelled = (batch["mask"][:len(chunk)] > 0) & (-batch["token_staleness"][:len(chunk)] == version)
    diff = np.abs(logp - batch["behaviour_logprobs"][:len(chunk)])
    for i, t in enumerate(chunk):
      d = diff[i][labelled[i]]
      if d.size:
        out.append(SpanCheck(t.key, int(version),
                             tuple((s.start, s.end) for s in t.spans if s.version == version),
                             int(d.size), float(d.mean()), float(d.max())))
  return out


def _pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  """``batch`` with rows of nothing (mask 0, no recorded route) up to ``rows``."""
  n = len(batch["mask"])
  if n == rows:
    return batch
  out = {}
  for k, v in batch.items():
    pad = np.zeros((rows - n,) + v.shape[1:], v.dtype)
    if k == "routing":
      pad[...] = no_route(v.dtype)
    out[k] = np.concatenate([v, pad])
  return out


class LabelAudit:
  """Keeps the audit sample's trajectories and checks their labels, one version per call."""

  def __init__(self, reader: SnapshotReader | None, learner: Any, *, tolerance: float,
               seq_buckets: Sequence[int], pad_id: int, max_rows: int):
    """``learner``: a ``jax_dora.learner.Learner`` (``logprobs_under``, ``params_target``);
    ``reader=None``: nothing is checked (a multi-process learner, where a program over the
    global parameters would need every learner process to join it)."""
    self.reader = reader
    self.learner = learner
    self.tolerance = float(tolerance)
    self.seq_buckets = tuple(seq_buckets)
    self.pad_id = int(pad_id)
    self.max_rows = int(max_rows)
    # (incarnation, version) -> trajectories with tokens labelled so, not checked yet.
    self._pending: dict[tuple[str, int], list[Trajectory]] = collections.defaultdict(list)
    self.checked = 0  # (trajectory, version) pairs recomputed
    self.unverifiable = 0  # pairs whose version was gone or unreadable
    self.skipped = 0  # pairs not checked to stay within the time budget
    self.largest = 0.0  # largest mean |stored - recomputed| over checked pairs
    self.checks: list[SpanCheck] = []  # every result, for reports (benchmarks, offline audit)

  @property
  def active(self) -> bool:
    return self.reader is not None

  def keep(self, trajs: Iterable[Trajectory]) -> None:
    if not self.active:
      return
    for t in trajs:
      for v in sorted({s.version for s in t.spans}):
        self._pending[(t.incarnation, v)].append(t)

  @property
  def pending_versions(self) -> list[tuple[str, int]]:
    return sorted(self._pending, key=lambda iv: iv[1])

  def verify_next(self) -> list[tuple[str, str]]:
    """Checks the oldest pending version; ``(kind, message)`` per violation."""
    # Versions already retired cost no restore: count them and take the next, so a step's
    # check goes to a version that can still be checked.
    while self._pending and not self.reader.has_version(self.pending_versions[0][1]):
      incarnation, version = self.pending_versions[0]
      self.unverifiable += len(self._pending.pop((incarnation, version)))
      log.debug("audit: version %d retired before its labels could be checked", version)
    if not self._pending:
      return []
    incarnation, version = self.pending_versions[0]
    trajs = self._pending.pop((incarnation, version))
    try:
      params, _ = self.reader.load(version, target=self.learner.params_target(),
                                   incarnation=incarnation or None)
    except SnapshotNotFoundError as e:
      self.unverifiable += len(trajs)
      log.warning("audit: %d trajectories' tokens labelled version %d cannot be checked: %s",
                  len(trajs), version, e)
      return []
    except (SnapshotIntegrityError, SnapshotCorruptError) as e:
      self.unverifiable += len(trajs)
      return [(SNAPSHOTS, f"snapshot version {version}: {e}")]
    checks = recompute(self.learner, params, trajs, version, seq_buckets=self.seq_buckets,
                       pad_id=self.pad_id, max_rows=self.max_rows)
    del params
    self.checked += len(checks)
    self.checks.extend(checks)
    out = []
    for c in checks:
      self.largest = max(self.largest, c.mean_abs)
      if c.mean_abs > self.tolerance:
        out.append((VERSION_LABELS,
                    f"{c.key}: tokens {list(c.spans)} labelled version {c.version}: their stored"
                    f" log-probs differ from version {c.version}'s by {c.mean_abs:.3g} on average"
                    f" (max {c.max_abs:.3g}, {c.tokens} tokens; tolerance {self.tolerance:g})"))
    return out

  def skip_next(self) -> None:
    """Drops the oldest pending version unchecked (over the time budget), counting it."""
    if self._pending:
      self.skipped += len(self._pending.pop(self.pending_versions[0]))

  def verify_all(self) -> list[tuple[str, str]]:
    """Drains every pending version (the end of a run, the offline audit)."""
    out = []
    while self._pending:
      out += self.verify_next()
    return out


def label_tolerance(cfg: RunConfig) -> float:
  """``audit.label_tolerance``, or by precision (``benchmarks/label_audit.py``, tiny policy,
  12-05): a right label's statistic is <= 4.8e-7 in float32 and <= 5.2e-3 in bfloat16; an
  adjacent version's is >= 2.7e-3 in float32, and above 1e-2 for ~96.5% of spans in
  bfloat16."""
  if cfg.audit.label_tolerance > 0:
    return cfg.audit.label_tolerance
  dtypes = {cfg.model.dtype, cfg.model.param_dtype, cfg.rollout.param_dtype or cfg.model.param_dtype}
  return 1e-3 if dtypes == {"float32"} else 1e-2


def build_label_audit(cfg: RunConfig, snapshot_dir: Any, learner: Any, tokenizer: Any, *,
                      enabled: bool = True) -> LabelAudit:
  """The run's :class:`LabelAudit` on ``learner``'s devices;
  ``enabled=False`` (a multi-process learner) builds an inactive one."""
  window = cfg.orchestrator.max_staleness + 2  # the oldest span's version, plus the newest
  if enabled and cfg.audit.verify_fraction > 0 and 0 < cfg.snapshots.max_to_keep < window:
    log.warning("snapshots.max_to_keep=%d keeps fewer versions than the audit's label check"
                " may need (max_staleness + 2 = %d): spans of retired versions are counted as"
                " unverifiable", cfg.snapshots.max_to_keep, window)
  reader = as_reader(snapshot_dir) if enabled and cfg.audit.verify_fraction > 0 else None
  return LabelAudit(
      reader, learner, tolerance=label_tolerance(cfg), seq_buckets=learner.seq_len_buckets,
      pad_id=tokenizer.pad_id, max_rows=label_max_rows(cfg))


def label_max_rows(cfg: RunConfig) -> int:
  """The most rows the label check puts in one forward: a training micro-batch's."""
  return cfg.learner.micro_batch_size or cfg.learner.batch_rows
