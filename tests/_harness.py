"""Real rollout-server processes for tests: a free port, a Health probe, a server subprocess.

Several test files start ``python -m jax_dora.rollout.server_main`` on
loopback and wait for it; one copy of how keeps their start-up arguments,
readiness check and cleanup from drifting apart (a fix to one copy used to
miss the others).
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

import grpc

from jax_dora.rollout import wire

REPO = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
  """A loopback port nobody listens on right now (the OS picks it; small race, fine in tests)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _health_call(channel: grpc.Channel):
  return channel.unary_unary(
      wire.method_path(wire.HEALTH),
      request_serializer=wire.dumps,
      response_deserializer=wire.loads,
  )


def health(address: str, timeout_s: float = 5.0) -> dict:
  """One Health call over a *sync* channel, closed afterwards.

  Sync on purpose: ``grpc.aio`` keeps process-wide state bound to the first
  event loop that used it, so a test helper must not spin up a loop of its own.
  """
  with grpc.insecure_channel(address) as channel:
    return _health_call(channel)({}, timeout=timeout_s)


class RolloutServerProcess:
  """A tiny-model ``server_main`` subprocess on a fresh loopback port, with its log.

  Args:
    snapshot_dir: ``config.snapshots.directory`` the server loads versions from.
    log_path: Where the server's stdout and stderr go.
    slots: ``config.rollout.slots``.
    model_overrides: ``config.model.*`` values (shrink the tiny model further).
  """

  def __init__(
      self,
      snapshot_dir: pathlib.Path,
      log_path: pathlib.Path,
      *,
      slots: int,
      model_overrides: Mapping[str, Any] | None = None,
  ):
    self.port = free_port()
    self.address = f"127.0.0.1:{self.port}"
    self.log_path = log_path
    args = [
        sys.executable, "-m", "jax_dora.rollout.server_main",
        "--config=configs/tiny.py", "--config.precompile=False", "--host=127.0.0.1", "--grace_s=1",
        f"--config.rollout.port={self.port}",
        f"--config.snapshots.directory={snapshot_dir}",
        f"--config.rollout.slots={slots}",
        "--config.rollout.devices_per_server=1",
    ] + [f"--config.model.{k}={v}" for k, v in (model_overrides or {}).items()]
    # One device is all a server of the tiny model uses; 8 forced host
    # devices would only multiply its start-up work.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    self._log = open(log_path, "wb")
    self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=self._log,
                                 stderr=subprocess.STDOUT)

  def log(self) -> str:
    return self.log_path.read_text(errors="replace")

  def wait_ready(self, timeout_s: float = 90.0) -> dict:
    """Polls Health until a version is loaded and returns that Health reply.

    Fails at once (with the log) if the process exits, and after
    ``timeout_s`` if it never loads a version.
    """
    with grpc.insecure_channel(self.address) as channel:  # sync: see ``health``
      call = _health_call(channel)
      deadline = time.monotonic() + timeout_s
      while time.monotonic() < deadline:
        if self.proc.poll() is not None:
          raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        try:
          h = call({}, timeout=1.0)
          if h["versions_loaded"]:
            return h
        except grpc.RpcError:
          pass
        time.sleep(0.2)
    raise AssertionError(f"server not ready in {timeout_s}s:\n{self.log()}")

  def signal(self, sig: int) -> None:
    """Sends ``sig`` if the process is still running (tests SIGSTOP/SIGCONT/SIGTERM it)."""
    if self.proc.poll() is None:
      self.proc.send_signal(sig)

  def close(self) -> None:
    """Kills the process (resuming it first if a test left it SIGSTOPped) and closes the log."""
    self.signal(signal.SIGCONT)
    self.signal(signal.SIGKILL)
    self.proc.wait(10)
    self._log.close()
