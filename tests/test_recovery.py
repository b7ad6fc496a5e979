"""Learner restarts against rollout servers that stay up (run incarnations).

A rollout server process outlives learner processes: after a learner is
killed and resumed from its checkpoint at step N, the server still holds the
killed run's versions N+1.. in memory, and after a run finishes, the next run
(new output directory, same snapshot directory) starts again at version 0
while the server holds the old run's last version. Version numbers alone
would let both runs train on parameters the learner never had (the server
ignoring ``load(N)`` as older than what it holds). Every start of a run has a
new incarnation id, carried in snapshot metadata, loads, requests and results;
here every trained record must carry the incarnation of the run that trained
it and the audits must be clean.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest
from _harness import free_port, health

from jax_dora.orchestrator.integrity import IntegrityLedger, read_log

pytestmark = pytest.mark.timeout(420)

_REPO = pathlib.Path(__file__).resolve().parents[1]
_MODEL = [f"--config.model.{k}={v}" for k, v in dict(d_model=32, n_layers=1, n_heads=2,
                                                       d_ff=64).items()]


def _train(out: pathlib.Path, snapshots: pathlib.Path, address: str, steps: int,
           *extra: str) -> list[str]:
  return [
      sys.executable, "-m", "jax_dora.train", "--config=configs/tiny.py",
      "--config.precompile=False", "--config.mode=dora",
      f"--config.output_dir={out}", f"--config.snapshots.directory={snapshots}",
      f"--config.total_steps={steps}", "--config.role=learner",
      f"--config.rollout.server_addresses={address}", "--config.checkpoint.every_steps=4",
      "--config.progress_bar=False", "--config.eval.num_prompts=0",
      "--config.eval.at_start=False", "--config.learner.groups_per_step=2",
      "--config.learner.group_size=4", *_MODEL, *extra,
  ]


def _audit(out: pathlib.Path, summary: dict) -> list[dict]:
  assert summary["integrity_violations"] == [], summary
  led = IntegrityLedger.from_log(out / "trained_samples.jsonl", group_size=4, max_staleness=2)
  assert led.check() == []
  return [r for r in read_log(out / "trained_samples.jsonl") if r["event"] == "trained"]


def test_resumed_and_next_runs_never_train_on_a_live_server_s_old_versions(tmp_path):
  port = free_port()
  address = f"127.0.0.1:{port}"
  snapshots = tmp_path / "snapshots"
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
  server_log = open(tmp_path / "server.log", "wb")
  server = subprocess.Popen(
      [sys.executable, "-m", "jax_dora.rollout.server_main", "--config=configs/tiny.py",
       "--config.precompile=False",
       "--host=127.0.0.1", "--grace_s=1", f"--config.rollout.port={port}",
       f"--config.snapshots.directory={snapshots}", "--config.rollout.slots=8", *_MODEL],
      cwd=_REPO, env=env, stdout=server_log, stderr=subprocess.STDOUT)
  try:
    # 1. A run killed (SIGKILL) once the server holds a version newer than
    # its last checkpoint (step 4).
    first = tmp_path / "first"
    proc = subprocess.Popen(_train(first, snapshots, address, 12), cwd=_REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 200
    held = -1
    while held < 5:
      assert proc.poll() is None, "training exited before it could be killed"
      assert time.time() < deadline, "the server never loaded version 5 in time"
      time.sleep(0.1)
      try:
        held = max(health(address)["versions_loaded"], default=-1)
      except grpc.RpcError:
        pass
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)

    # 2. Resumed against the same live server: it must drop the killed run's
    # versions; nothing the resumed run trains comes from them.
    done = subprocess.run(_train(first, snapshots, address, 8), cwd=_REPO, env=env,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((first / "summary.json").read_text())
    assert summary["steps"] == 8
    trained = _audit(first, summary)
    resumed_from = [r for r in read_log(first / "trained_samples.jsonl")
                    if r["event"] == "run_start"][-1]["resumed_from_step"]
    assert 4 <= resumed_from < held  # the server held the killed run's newer versions
    assert {r["incarnation"] for r in trained if r["step"] > resumed_from} == {
        summary["incarnation"]}
    assert {r["incarnation"] for r in trained if r["step"] <= resumed_from} - {
        summary["incarnation"]}, "the killed run's records should carry its own incarnation"

    # 3. The next run: new output directory, same snapshot directory, same
    # server (which holds the finished run's version 8); a fresh run restarts
    # at version 0, which must not be the old run's version 0 either.
    second = tmp_path / "second"
    done = subprocess.run(_train(second, snapshots, address, 3), cwd=_REPO, env=env,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    summary2 = json.loads((second / "summary.json").read_text())
    trained2 = _audit(second, summary2)
    assert len(trained2) == 3 * 8
    assert {r["incarnation"] for r in trained2} == {summary2["incarnation"]}
    assert summary2["incarnation"] != summary["incarnation"]
    assert all(max(s[2] for s in r["spans"]) <= r["learner_version"] for r in trained2)
    server_text = (tmp_path / "server.log").read_text(errors="replace")
    assert f"now serving run incarnation {summary2['incarnation']}" in server_text
  finally:
    server.send_signal(signal.SIGTERM)
    try:
      server.wait(30)
    except subprocess.TimeoutExpired:
      server.kill()
    server_log.close()
