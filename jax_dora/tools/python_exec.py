"""The ``python`` tool: model-written code, run contained, one process tree per call.

Each call gets a fresh sandbox (``sandbox.py``: new namespaces, a read-only
allowlisted root, a private tmpfs working directory, an unprivileged uid of
its own when the orchestrator is root or a user namespace of its own when it
is not, rlimits), a wall-clock deadline after which the whole tree is
SIGKILLed, and an output budget (``output.py``). Nothing is shared between
calls: no interpreter state, no files. That costs a process start per call
(see DESIGN.md for the measured overhead) and buys independence: a call
cannot see, slow down after the fact, or break another.

Calls are plain ``asyncio`` subprocesses, so many run in parallel without
blocking the event loop and without threads of ours; the concurrency limit
is the executor's (``executor.ToolExecutor``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import weakref

from jax_dora.tools import base, sandbox
from jax_dora.tools.output import BoundedOutput
from jax_dora.tools.sandbox_runner import MAIN, MEMORY_EXIT_CODE

_log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 16
# How long the output may keep coming after the process ended (fallback only:
# a daemonised child can hold the pipe; the namespaces mode kills it).
_DRAIN_GRACE_S = 1.0
AUTO = "auto"


def _close_transport(proc: asyncio.subprocess.Process) -> None:
  """Closes an abandoned call's pipes now.

  ``asyncio.subprocess.Process`` has no public close: a call given up before
  its output ended (cancelled) would otherwise keep its transport until the
  event loop closes, and complain then.
  """
  transport = getattr(proc, "_transport", None)
  if transport is not None:
    transport.close()


def _remove_dir(path: str) -> None:
  try:
    os.rmdir(path)
  except OSError:
    pass


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return str(signum)


def _default_uid_base() -> int:
  """A block of 1000 uids per orchestrator process, far above real accounts.

  Distinct blocks keep two executors on one host (two runs, or tests) from
  sharing a uid, whose process count RLIMIT_NPROC would then share.
  """
  return 1_000_000 + (os.getpid() % 10_000) * 1_000


class PythonTool:
  """Runs a Python program per call; see the module docstring.

  Args:
    limits: Per-call resource limits.
    max_output_bytes: Observation budget (stdout and stderr together, in the
      order written); the middle of a longer output is cut.
    isolation: ``"namespaces"``, ``"userns"``, ``"process"`` or ``"auto"``:
      ``namespaces`` as root, ``userns`` otherwise, when the host allows them
      (checked by one real call), else ``process``.
    python: Interpreter to run (default: this process's, so the sandbox has
      the run's packages, e.g. numpy and sympy, read-only).
    protected: Paths the code must not read (the run's output directory).
      Under ``namespaces`` nothing outside the allowlist is visible anyway;
      a protected path inside it is covered.
    readonly: Extra host paths to expose read-only (``namespaces``).
    uid_base: First uid of the block the calls run as (``namespaces``).
    max_code_bytes: Longest accepted program.
  """

  name = "python"

  def __init__(
      self,
      limits: sandbox.Limits | None = None,
      max_output_bytes: int = 8192,
      isolation: str = AUTO,
      python: str | None = None,
      protected: tuple[str, ...] = (),
      readonly: tuple[str, ...] = (),
      uid_base: int | None = None,
      max_code_bytes: int = 1 << 20,
  ):
    if isolation not in sandbox.ISOLATIONS + (AUTO,):
      raise ValueError(f"unknown isolation {isolation!r}; known: {sandbox.ISOLATIONS + (AUTO,)}")
    if isolation in sandbox.NAMESPACED:
      reason = sandbox.namespace_prerequisites(isolation)
      if reason:
        raise ValueError(f"isolation {isolation!r} is not available here: {reason}")
    if max_output_bytes <= 0:
      raise ValueError(f"max_output_bytes must be > 0, got {max_output_bytes}")
    self.limits = limits or sandbox.Limits()
    self.max_output_bytes = int(max_output_bytes)
    # Its directory resolved (the file itself may stay a link, as a venv's is): the
    # sandbox's private root binds resolved prefixes, so a venv reached through a
    # linked directory must be run by its real path there.
    python = python or sys.executable
    self.python = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(python))),
                               os.path.basename(python))
    if not os.access(self.python, os.X_OK):
      raise ValueError(f"python tool: interpreter {self.python!r} is not executable")
    self.protected = tuple(os.path.abspath(p) for p in protected)
    self.readonly = sandbox.readonly_paths(self.python, tuple(readonly))
    self.site_paths = sandbox.site_paths(self.python)
    self.uid_base = _default_uid_base() if uid_base is None else int(uid_base)
    self.max_code_bytes = int(max_code_bytes)
    self.isolation: str | None = None if isolation == AUTO else isolation
    self.isolation_note = "" if isolation == AUTO else "chosen in the config"
    self._probe_lock: asyncio.Lock | None = None
    self._running: dict[asyncio.subprocess.Process, str] = {}
    self._free_slots: list[int] = []
    self._slots = 0
    self._root: str | None = None
    self._finalizer: weakref.finalize | None = None

  # --------------------------------------------------------------- isolation
  async def resolve_isolation(self) -> str:
    """The isolation in use; under ``auto``, decided by one trial call the first time."""
    if self.isolation is not None:
      return self.isolation
    if self._probe_lock is None:
      self._probe_lock = asyncio.Lock()
    async with self._probe_lock:
      if self.isolation is None:
        # Root builds the sandbox directly; anybody else in a user namespace of its own.
        candidate = sandbox.NAMESPACES if os.geteuid() == 0 else sandbox.USERNS
        reason = sandbox.namespace_prerequisites(candidate)
        if reason is None:
          trial = await self._run_isolated(
              base.ToolCall("python", "print('ok')"), candidate, time.monotonic(),
              dataclasses.replace(self.limits, wall_s=max(self.limits.wall_s, 10.0)))
          if trial.status != base.OK or trial.observation.strip() != "ok":
            reason = f"a trial call failed ({trial.status}): {trial.observation[:500]}"
        if reason is None:
          self.isolation, self.isolation_note = candidate, f"{candidate} work here"
        else:
          self.isolation, self.isolation_note = sandbox.PROCESS, reason
          _log.warning("python tool: OS sandbox unavailable (%s); falling back to "
                       "'process' isolation, which an audit hook guards and ctypes can "
                       "bypass (see DESIGN.md)", reason)
      return self.isolation

  # --------------------------------------------------------------------- run
  async def run(self, call: base.ToolCall) -> base.ToolResult:
    start = time.monotonic()
    if len(call.arguments.encode("utf-8", errors="replace")) > self.max_code_bytes:
      return base.ToolResult(f"[error: the program is longer than {self.max_code_bytes} bytes]",
                             base.ERROR, wall_s=time.monotonic() - start)
    isolation = await self.resolve_isolation()
    return await self._run_isolated(call, isolation, start, self.limits)

  def _root_mount_point(self) -> str:
    """An empty host directory each call mounts its new root on, in its own
    mount namespace (so it stays empty on the host); removed with the tool."""
    if self._root is None:
      self._root = tempfile.mkdtemp(prefix="jax-dora-sandbox-root-")
      self._finalizer = weakref.finalize(self, _remove_dir, self._root)
    return self._root

  def _take_slot(self) -> int:
    if self._free_slots:
      return self._free_slots.pop()
    self._slots += 1
    return self._slots - 1

  async def _run_isolated(self, call: base.ToolCall, isolation: str, start: float,
                          limits: sandbox.Limits) -> base.ToolResult:
    code = call.arguments.encode("utf-8", errors="replace")
    token = secrets.token_hex(8)
    slot = self._take_slot()
    workdir = None
    try:
      if isolation in sandbox.NAMESPACED:
        argv = sandbox.namespace_argv(self.python, limits, self.uid_base + slot,
                                      self._root_mount_point(), self.readonly, self.protected,
                                      token, self.site_paths,
                                      user_namespace=isolation == sandbox.USERNS)
        cwd, env, stdin = "/", sandbox.environment("/tmp"), asyncio.subprocess.PIPE
      else:
        workdir = tempfile.mkdtemp(prefix="jax-dora-tool-")
        with open(os.path.join(workdir, MAIN), "wb") as f:
          f.write(code)
        argv = sandbox.process_argv(self.python, limits, workdir, self.protected,
                                    self.site_paths)
        cwd, env, stdin = workdir, sandbox.environment(workdir), asyncio.subprocess.DEVNULL
      try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=stdin, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            cwd=cwd, env=env, start_new_session=True)
      except OSError as e:
        return base.ToolResult(f"[sandbox error: could not start: {e}]", base.SANDBOX_ERROR,
                               wall_s=time.monotonic() - start)
      code_in = code if isolation in sandbox.NAMESPACED else None
      return await self._supervise(proc, isolation, code_in, start, limits, token)
    finally:
      self._free_slots.append(slot)
      if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)

  async def _supervise(self, proc: asyncio.subprocess.Process, isolation: str,
                       code: bytes | None, start: float, limits: sandbox.Limits,
                       token: str) -> base.ToolResult:
    """Feeds the program, collects bounded output, enforces the deadline, cleans up."""
    self._running[proc] = isolation
    out = BoundedOutput(self.max_output_bytes)
    reader = asyncio.create_task(self._pump(proc, code, out))
    timed_out = False
    try:
      try:
        await asyncio.wait_for(proc.wait(), limits.wall_s)
      except asyncio.TimeoutError:
        timed_out = True
      if not await sandbox.kill(proc, isolation):
        _log.warning("python tool: call %d was still running after SIGKILL", proc.pid)
      done, _ = await asyncio.wait({reader}, timeout=_DRAIN_GRACE_S)
      if not done:  # a process outside our reach holds the pipe (fallback only)
        reader.cancel()
        _log.warning("python tool: output of call %d still open after the process ended; "
                     "a daemonised child may be left (isolation=%s)", proc.pid, isolation)
    finally:
      if proc.returncode is None or not reader.done():  # cancelled, or a pipe left open
        sandbox.kill_now(proc, isolation)
        reader.cancel()
        _close_transport(proc)
      self._running.pop(proc, None)
    return self._result(proc.returncode, timed_out, out, isolation, limits, token,
                        time.monotonic() - start)

  @staticmethod
  async def _pump(proc: asyncio.subprocess.Process, code: bytes | None, out: BoundedOutput) -> None:
    if code is not None and proc.stdin is not None:
      try:
        proc.stdin.write(code)
        await proc.stdin.drain()
      except (BrokenPipeError, ConnectionResetError):
        pass  # the setup failed before reading it; its message says why
      finally:
        proc.stdin.close()
    while chunk := await proc.stdout.read(_READ_CHUNK):
      out.add(chunk)

  # ------------------------------------------------------------- classifying
  @staticmethod
  def _result(rc: int | None, timed_out: bool, out: BoundedOutput, isolation: str,
              limits: sandbox.Limits, token: str, wall_s: float) -> base.ToolResult:
    text = out.text()
    signum = None
    if rc is not None and rc < 0:
      signum = -rc
    elif rc is not None and isolation in sandbox.NAMESPACED and 128 < rc <= 128 + 64:
      signum = rc - 128  # sandbox_init reports a child killed by signal N as 128 + N
    if timed_out:
      status, note = base.TIMEOUT, (f"timed out: no result within {limits.wall_s:g} s; "
                                    "the program was killed")
    elif (isolation in sandbox.NAMESPACED and rc == sandbox.SETUP_FAILED_EXIT_CODE
          and text.startswith(f"{sandbox.SETUP_FAILED} [{token}]")):
      _log.error("python tool: %s", text.strip())
      status, note, text = base.SANDBOX_ERROR, "sandbox error: the sandbox could not start", ""
    elif signum == signal.SIGXCPU:
      status, note = base.TIMEOUT, f"CPU time limit of {limits.cpu_s} s exceeded"
    elif rc == MEMORY_EXIT_CODE:
      status, note = base.MEMORY, (f"memory limit of {limits.memory_bytes >> 20} MiB "
                                   "exceeded")
    elif signum is not None:
      status, note = base.KILLED, f"killed by signal {_signal_name(signum)}"
    elif rc == 0:
      status, note = base.OK, ""
    else:
      status, note = base.ERROR, f"exit code {rc}"
    if note:
      text = f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}[{note}]"
    exit_code = (128 + signum) if signum is not None else rc
    return base.ToolResult(text, status, exit_code=exit_code, wall_s=wall_s,
                           truncated=out.truncated, output_bytes=out.total)

  # ------------------------------------------------------------------- close
  def close(self) -> None:
    """SIGKILLs every call still running (their ``run`` then returns).

    The tool stays usable; its root mount point goes at exit (or on
    garbage collection), as calls may still be finishing.
    """
    for proc, isolation in list(self._running.items()):
      sandbox.kill_now(proc, isolation)


base.TOOLS.register(PythonTool.name, PythonTool)
