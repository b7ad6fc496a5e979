"""Metrics and the trained-sample log on an object store (``gs://`` URIs).

GCS cannot be reached from the tests, so ``gs://`` is served by an in-memory
fsspec filesystem with the two limits of an object store that matter here: no
append mode (gcsfs silently overwrites on ``mode="a"``; here it raises) and no
rename (a copy plus a delete on GCS, so not atomic; here it raises). The URIs
go through the real ``etils.epath`` dispatch for ``gs://`` (its fsspec
backend, the one it picks when TensorFlow's gfile is not used); only the
filesystem object behind it is the fake. Every test runs in an empty working
directory and checks that it stays empty: the old code created a local
directory literally named ``gs:`` there.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from etils import epath
from etils.epath import backend as epath_backend
from etils.epath import gpath
from fsspec.implementations.memory import MemoryFileSystem

from _traj import make_group
from jax_dora.metrics.jsonl import MetricsWriter, is_remote, read_metrics
from jax_dora.orchestrator.integrity import IntegrityLedger, read_log

G = 2
RUN = "gs://bucket/run"


class FakeGcs(MemoryFileSystem):
  """In-memory GCS: objects are written whole; no append, no rename."""

  protocol = ("gs", "gcs")
  cachable = False  # a fresh, empty store per test

  def __init__(self):
    super().__init__(global_store=False)
    self.uploads: list[str] = []  # object paths, one per completed write
    self.fail_next_upload = False

  @classmethod
  def _strip_protocol(cls, path):
    path = str(path)
    for prefix in ("gs://", "gcs://"):
      path = path.removeprefix(prefix)
    return super()._strip_protocol(path)

  def _open(self, path, mode="rb", **kwargs):
    if "a" in mode or "+" in mode:
      raise NotImplementedError(f"GCS objects cannot be appended to ({mode=})")
    if "w" in mode:
      if self.fail_next_upload:
        self.fail_next_upload = False
        raise ConnectionError("simulated GCS outage")
      self.uploads.append(self._strip_protocol(path))
    return super()._open(path, mode=mode, **kwargs)

  def mv(self, *args, **kwargs):
    raise NotImplementedError("GCS has no atomic rename")

  def text(self, uri: str) -> str:
    return self.cat_file(uri).decode()


@pytest.fixture
def gcs(monkeypatch, tmp_path):
  """Serves ``gs://`` from a :class:`FakeGcs`; the cwd is an empty directory."""
  fake = FakeGcs()
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)  # fsspec backend, not gfile
  monkeypatch.setattr(epath_backend.fsspec_backend, "fs", lambda path: fake)
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  yield fake
  assert list(cwd.iterdir()) == [], "a gs:// output wrote into the local working directory"
  assert not pathlib.Path("/gs:").exists()


def _steps(uri):
  return [r["step"] for r in read_metrics(uri)]


def test_epath_dispatches_gs_to_the_fake(gcs):
  p = epath.Path(f"{RUN}/probe.txt")
  p.write_text("x")
  assert gcs.text(f"{RUN}/probe.txt") == "x" and p.read_text() == "x"
  assert is_remote(p) and is_remote(str(p)) and not is_remote("runs/gs/x")


@pytest.mark.parametrize("as_type", [str, epath.Path])
def test_metrics_writer_writes_readable_objects(gcs, as_type):
  uri = as_type(f"{RUN}/metrics.jsonl")
  with MetricsWriter(uri, flush_interval_s=0) as w:
    w.write({"loss": 0.5}, step=1)
    assert _steps(uri) == [1]  # uploaded while the writer is open
    w.write({"loss": 0.25}, step=2)
    assert _steps(uri) == [1, 2]
  recs = read_metrics(uri)
  assert [r["loss"] for r in recs] == [0.5, 0.25] and all(r["time"] > 0 for r in recs)
  assert [json.loads(ln)["step"] for ln in gcs.text(f"{RUN}/metrics.jsonl").splitlines()] == [1, 2]


def test_metrics_resume_truncates_the_object(gcs):
  uri = f"{RUN}/metrics.jsonl"
  with MetricsWriter(uri, keep_through_step=0) as w:
    for s in range(1, 6):
      w.write({"x": s}, step=s)
  with MetricsWriter(uri, keep_through_step=3) as w:  # resumed from the step-3 checkpoint
    assert _steps(uri) == [1, 2, 3]  # truncated at once, like the local file
    w.write({"x": 4}, step=4)
  assert _steps(uri) == [1, 2, 3, 4]
  with MetricsWriter(uri) as w:  # keep_through_step=None continues the object
    w.write({"x": 5}, step=5)
  assert _steps(uri) == [1, 2, 3, 4, 5]
  MetricsWriter(uri, keep_through_step=0).close()  # a fresh run starts empty
  assert read_metrics(uri) == [] and gcs.exists(uri)


def test_remote_uploads_are_throttled_and_flushed_on_close(gcs):
  uri = f"{RUN}/metrics.jsonl"
  w = MetricsWriter(uri, flush_interval_s=3600)
  n = len(gcs.uploads)
  for s in range(1, 4):
    w.write({"x": s}, step=s)
  assert len(gcs.uploads) == n and read_metrics(uri) == []  # within the interval: buffered
  w.flush()
  assert _steps(uri) == [1, 2, 3]
  w.write({"x": 4}, step=4)
  w.close()
  assert _steps(uri) == [1, 2, 3, 4] and len(gcs.uploads) == n + 2
  with pytest.raises(ValueError, match="closed"):
    w.write({"x": 5})


def test_a_failed_upload_is_retried_not_fatal(gcs):
  uri = f"{RUN}/metrics.jsonl"
  with MetricsWriter(uri, flush_interval_s=0) as w:
    gcs.fail_next_upload = True
    w.write({"x": 1}, step=1)  # the upload fails: logged, the record stays buffered
    assert read_metrics(uri) == []
    w.write({"x": 2}, step=2)
  assert _steps(uri) == [1, 2]


def _issue_finish(led, sid, version=0, finish_version=None):
  group = make_group(sid, G, version=version, finish_version=finish_version)
  for t in group:
    led.issued(sid, t.member, version)
  for t in group:
    led.finished(t)
  return group


def test_ledger_on_gs_resumes_truncates_and_audits(gcs):
  uri = f"{RUN}/trained_samples.jsonl"
  led = IntegrityLedger(uri, group_size=G, max_staleness=1, flush_interval_s=0)
  led.trained(_issue_finish(led, 0), learner_version=0, step=1)  # checkpoint at step 1
  led.trained(_issue_finish(led, 1), learner_version=1, step=2)  # lost with the kill
  # Killed here (no close): with flush_interval_s=0 every batch is already uploaded.
  trained = [r for r in read_log(uri) if r["event"] == "trained"]
  assert [(r["sample_id"], r["step"]) for r in trained] == [(0, 1), (0, 1), (1, 2), (1, 2)]

  led = IntegrityLedger(uri, group_size=G, max_staleness=1, truncate_after_step=1)
  assert [(r["sample_id"], r["step"]) for r in read_log(uri)] == [(0, 1), (0, 1)]
  led.trained(_issue_finish(led, 1, version=1, finish_version=1), learner_version=1, step=2)
  assert led.check() == []
  led.trained(_issue_finish(led, 0, version=2, finish_version=2), learner_version=2, step=3)
  assert "(0, 0): trained 2 times" in led.check()
  led.close()
  replay = IntegrityLedger.from_log(uri, group_size=G, max_staleness=1)
  assert "(0, 0): trained 2 times" in replay.check()
  assert [r["event"] for r in read_log(uri)].count("run_start") == 1

  fresh = IntegrityLedger(uri, group_size=G, max_staleness=1, truncate_after_step=0)
  assert fresh.trained_records() == []
  fresh.close()
  assert [r["event"] for r in read_log(uri)] == ["run_start"]


def test_ledger_uploads_a_learner_step_whole(gcs):
  """A snapshot of the log never holds part of one step's trained records."""
  uri = f"{RUN}/trained_samples.jsonl"
  with IntegrityLedger(uri, group_size=G, max_staleness=1, flush_interval_s=0) as led:
    groups = _issue_finish(led, 0) + _issue_finish(led, 1)
    n = len(gcs.uploads)
    led.trained(groups, learner_version=0, step=1)
    assert len(gcs.uploads) == n + 1  # one upload for the whole batch
    trained = [r for r in read_log(uri) if r["event"] == "trained"]
    assert sorted((r["sample_id"], r["member"]) for r in trained) == [(0, 0), (0, 1), (1, 0),
                                                                       (1, 1)]


def test_ledger_flush_makes_buffered_events_durable(gcs):
  uri = f"{RUN}/trained_samples.jsonl"
  led = IntegrityLedger(uri, group_size=G, max_staleness=1, flush_interval_s=3600)
  led.trained(_issue_finish(led, 0), learner_version=0, step=1)
  assert read_log(uri) == []  # throttled
  led.flush()  # what a checkpoint does first
  assert IntegrityLedger.from_log(uri, group_size=G, max_staleness=1).check() == []
  led.close()


def test_local_paths_still_append_and_accept_path_objects(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  path = epath.Path(tmp_path) / "out" / "metrics.jsonl"
  with MetricsWriter(path, flush_interval_s=3600) as w:  # the interval is for URIs only
    w.write({"x": 1}, step=1)
    assert _steps(path) == [1]  # a local line is flushed at once
  with MetricsWriter(pathlib.Path(path), keep_through_step=0) as w:
    w.write({"x": 2}, step=2)
  assert _steps(path) == [2]
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["metrics.jsonl"]  # no .tmp left
