"""Multi-process run on CPU: learner and rollout server in one jax.distributed cluster.

Two local processes join one ``jax.distributed`` cluster (coordinator on
loopback), the way the roles of a multi-host job do: process 0 is the learner
(``python -m jax_dora.train`` with remote rollout), process 1 a gRPC rollout
server (``python -m jax_dora.rollout.server_main``). They exchange Orbax
snapshots through a shared directory and run a short ``dora`` training to the
end. What this pins down:

* with ``jax.distributed`` ``jax.devices()`` is global, yet no jit of either
  role may span the other's devices: the learner builds its mesh from its own
  process's devices, the server from its local devices;
* Orbax's multi-process coordination (barriers, primary-host-only writes) is
  scoped to each role: the learner publishes and checkpoints alone, the server
  restores alone, so neither waits on a barrier the other never reaches;
* the processes leave the cluster together: the learner finishes (summary
  written), then the server is stopped with SIGTERM and both exit 0.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from _harness import free_port, health

pytestmark = pytest.mark.timeout(150)

_REPO = pathlib.Path(__file__).resolve().parents[1]
_STEPS = 4
_MODEL = dict(d_model=32, n_layers=1, n_heads=2, d_ff=64)
# The two-learner test's policy: a mixture of experts split over an expert mesh axis.
_MOE = dict(_MODEL, num_experts=4, num_experts_per_tok=2, moe_d_ff=32)


def _tail(path: pathlib.Path, n: int = 4000) -> str:
  return path.read_text(errors="replace")[-n:] if path.exists() else "<no log>"


# `slow`: the two-learner test below runs the same cluster machinery (roles
# sharing a cluster, Orbax scoped per role, a server process in the cluster)
# with one more process; this one keeps the single-process learner's path.
@pytest.mark.slow
def test_learner_and_rollout_server_in_one_distributed_cluster(tmp_path):
  coordinator = f"127.0.0.1:{free_port()}"
  rollout_port = free_port()
  snapshots = tmp_path / "shared_snapshots"
  out = tmp_path / "run"
  dist = [
      "--config.distributed.enabled=True",
      f"--config.distributed.coordinator_address={coordinator}",
      "--config.distributed.num_processes=2",
      "--config.distributed.num_learner_processes=1",
  ]
  # --config must come before any --config.* override.
  common = [
      f"--config.snapshots.directory={snapshots}",
      "--config.rollout.slots=8",
      "--config.rollout.devices_per_server=1",
  ] + [f"--config.model.{k}={v}" for k, v in _MODEL.items()] + dist
  server_args = [
      sys.executable, "-m", "jax_dora.rollout.server_main", "--config=configs/tiny.py",
      "--config.precompile=False",
      "--host=127.0.0.1", "--grace_s=1",
      f"--config.rollout.port={rollout_port}",
      "--config.distributed.process_id=1",
  ] + common
  learner_args = [
      sys.executable, "-m", "jax_dora.train", "--config=configs/tiny.py",
      "--config.precompile=False",
      "--config.mode=dora",
      f"--config.total_steps={_STEPS}",
      f"--config.output_dir={out}",
      f"--config.rollout.server_addresses=127.0.0.1:{rollout_port}",
      "--config.role=learner",
      "--config.learner.num_devices=2",
      "--config.learner.groups_per_step=2",
      "--config.learner.group_size=4",
      "--config.eval.num_prompts=0",
      "--config.eval.at_start=False",
      "--config.progress_bar=False",
      "--config.distributed.process_id=0",
  ] + common
  # Fewer forced host devices per process: 4 + 4 = the 8 of a single-process run.
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      TF_CPP_MIN_LOG_LEVEL="3",
      XLA_FLAGS="--xla_force_host_platform_device_count=4",
  )
  server_log, learner_log = tmp_path / "server.log", tmp_path / "learner.log"
  procs: list[subprocess.Popen] = []
  logs = [open(server_log, "wb"), open(learner_log, "wb")]
  try:
    server = subprocess.Popen(
        server_args, cwd=_REPO, env=env, stdout=logs[0], stderr=subprocess.STDOUT)
    procs.append(server)
    learner = subprocess.Popen(
        learner_args, cwd=_REPO, env=env, stdout=logs[1], stderr=subprocess.STDOUT)
    procs.append(learner)

    def logs_text() -> str:
      return (f"--- learner ---\n{_tail(learner_log)}\n"
              f"--- server ---\n{_tail(server_log)}")

    # The learner writes summary.json when training is done, then waits in
    # jax.distributed's shutdown barrier for the server to leave too.
    summary_path = out / "summary.json"
    deadline = time.monotonic() + 110
    while not summary_path.exists():
      for p in procs:
        if p.poll() is not None:
          raise AssertionError(f"{p.args[2]} exited early with {p.returncode}\n{logs_text()}")
      if time.monotonic() > deadline:
        raise AssertionError(f"training did not finish in time\n{logs_text()}")
      time.sleep(0.5)
    time.sleep(0.5)  # summary.json is written in one call; let it land

    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == _STEPS, summary
    assert summary["integrity_violations"] == [], summary

    # The server loaded versions the learner published after start-up.
    h = health(f"127.0.0.1:{rollout_port}")
    assert max(h["versions_loaded"]) > 0, h
    loaded = [int(v) for v in re.findall(r"loaded version (\d+)", _tail(server_log, 10**6))]
    assert loaded and max(loaded) > 0, logs_text()

    server.send_signal(signal.SIGTERM)
    assert server.wait(30) == 0, logs_text()
    assert learner.wait(30) == 0, logs_text()

    learner_text, server_text = _tail(learner_log, 10**6), _tail(server_log, 10**6)
    # Each role on its own process's devices: 2 learner devices, and the
    # server's one device belongs to process 1 (ids of process 0 come first).
    assert ("learner mesh {'data': 2, 'fsdp': 1, 'expert': 1, 'tensor': 1} on 2 devices of 1"
            " process(es); remote") in learner_text
    m = re.search(r"driver on 1 device\(s\) \[cpu:(\d+)\]", server_text)
    assert m and int(m.group(1)) >= 4, server_text[-3000:]
    assert "jax.distributed initialised: process 1 of 2" in server_text
    assert "stopped" in server_text
    # Snapshots went through the shared directory (Orbax step dirs).
    assert any(p.name.isdigit() for p in snapshots.iterdir())
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(10)
    for f in logs:
      f.close()


@pytest.mark.timeout(330)
def test_two_learner_processes_train_like_one(tmp_path):
  """Two learner processes + one rollout server in one jax.distributed cluster, an MoE
  policy with its experts split over the learner mesh's expert axis (data 2 x expert 2
  over the two processes' four devices).

  Only the primary learner process runs the orchestrator; the other mirrors its
  train steps, publishes and checkpoints on the identical global batch. The
  run must finish a ``dora_pace`` run with a clean audit, and its per-step
  losses must equal a one-process learner's (same devices count and mesh
  shape, built here, fused step) replaying the exact batches the run trained
  on with length-grouped micro-batches.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jax_dora.config import base_config  # pylint: disable=g-import-not-at-top
  from jax_dora.learner.batch_dump import load_batches  # pylint: disable=g-import-not-at-top
  from jax_dora.learner.mesh import make_mesh  # pylint: disable=g-import-not-at-top
  from jax_dora.learner.train_state import Learner  # pylint: disable=g-import-not-at-top
  from jax_dora.orchestrator.integrity import IntegrityLedger  # pylint: disable=g-import-not-at-top
  from jax_dora.policy import resolve_policy  # pylint: disable=g-import-not-at-top

  coordinator = f"127.0.0.1:{free_port()}"
  rollout_port = free_port()
  out, batches = tmp_path / "run", tmp_path / "batches"
  common = [
      f"--config.snapshots.directory={tmp_path / 'snapshots'}",
      "--config.rollout.slots=8", "--config.rollout.devices_per_server=1",
      "--config.distributed.enabled=True",
      f"--config.distributed.coordinator_address={coordinator}",
      "--config.distributed.num_processes=3",
      "--config.distributed.num_learner_processes=2",
      # Versions in bfloat16 (as configs/tpu_pod_7b.py): every learner process detaches into it
      # and saves its shards; with op headers as device collectives this hung at version 2.
      "--config.snapshots.write_dtype=bfloat16",
  ] + [f"--config.model.{k}={v}" for k, v in _MOE.items()]
  server_args = [
      sys.executable, "-m", "jax_dora.rollout.server_main", "--config=configs/tiny.py",
      "--config.precompile=False",
      "--host=127.0.0.1", "--grace_s=1", f"--config.rollout.port={rollout_port}",
      "--config.distributed.process_id=2",
  ] + common
  learner_args = [
      sys.executable, "-m", "jax_dora.train", "--config=configs/tiny.py",
      "--config.precompile=False",
      "--config.mode=dora_pace", f"--config.total_steps={_STEPS}",
      f"--config.output_dir={out}", "--config.role=learner",
      f"--config.rollout.server_addresses=127.0.0.1:{rollout_port}",
      "--config.learner.num_devices=-1", "--config.learner.groups_per_step=2",
      "--config.learner.group_size=4", "--config.eval.num_prompts=0",
      "--config.eval.at_start=False", "--config.progress_bar=False",
      "--config.checkpoint.every_steps=2",
      f"--config.learner.dump_batches_dir={batches}",
      # The multi-process step runs length-grouped micro-batches (a host loop
      # of jitted calls every process must take identically); the replay
      # below is the fused one-process step.
      "--config.learner.micro_batch_size=4",
      "--config.learner.group_micro_batches_by_length=True",
      "--config.learner.mesh_expert=2",
  ] + common
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  names = ["server", "learner0", "learner1"]
  logs = {n: tmp_path / f"{n}.log" for n in names}
  files = [open(logs[n], "wb") for n in names]
  procs: dict[str, subprocess.Popen] = {}
  try:
    for n, f in zip(names, files):
      args = server_args if n == "server" else learner_args + [
          f"--config.distributed.process_id={n[-1]}"]
      procs[n] = subprocess.Popen(args, cwd=_REPO, env=env, stdout=f, stderr=subprocess.STDOUT)

    def logs_text() -> str:
      return "\n".join(f"--- {n} ---\n{_tail(logs[n])}" for n in names)

    # Done when the primary wrote its summary and the follower got STOP; then
    # all three leave the cluster together (the learners wait in
    # jax.distributed's shutdown barrier for the server).
    deadline = time.monotonic() + 240
    while not ((out / "summary.json").exists()
               and "steps mirrored" in _tail(logs["learner1"], 10**6)):
      for n, p in procs.items():
        if p.poll() is not None:
          raise AssertionError(f"{n} exited early with {p.returncode}\n{logs_text()}")
      if time.monotonic() > deadline:
        raise AssertionError(f"training did not finish in time\n{logs_text()}")
      time.sleep(0.5)
    time.sleep(0.5)
    procs["server"].send_signal(signal.SIGTERM)
    for n in names:
      assert procs[n].wait(60) == 0, logs_text()
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait(10)
    for f in files:
      f.close()

  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == _STEPS and summary["integrity_violations"] == [], summary
  ledger = IntegrityLedger.from_log(out / "trained_samples.jsonl", group_size=4, max_staleness=2)
  assert ledger.check() == []
  # One orchestrator: the follower drew no prompts and sent no requests.
  follower = _tail(logs["learner1"], 10**6)
  assert f"learner follower: {_STEPS} steps mirrored; primary finished" in follower
  assert "of 2 process(es); remote rollout" in _tail(logs["learner0"], 10**6)
  # Both learner processes saved their shards of the run checkpoints.
  assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]

  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  run_losses = [r["train/loss"] for r in recs]
  cfg = base_config()
  for k, v in _MOE.items():
    cfg.model[k] = v
  cfg.learner.groups_per_step, cfg.learner.group_size = 2, 4
  policy = resolve_policy(cfg)
  assert policy.model_cfg.num_experts == 4
  import jax  # pylint: disable=g-import-not-at-top

  mesh = make_mesh(jax.devices()[:4], -1, 1, 1, expert=2)
  solo = Learner(policy.model_cfg, cfg.learner, mesh, temperature=cfg.rollout.temperature,
                 seed=cfg.seed, suppress_mask=policy.suppress_mask)
  solo_losses = [solo.train_step(b)["loss"] for b in load_batches(str(batches))]
  assert len(solo_losses) == _STEPS
  np.testing.assert_allclose(run_losses, solo_losses, rtol=1e-5, atol=1e-6)
