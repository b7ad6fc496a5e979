"""Operating-system containment for one run of untrusted code.

Two ways to run the interpreter, chosen once per tool (see
``python_exec.PythonTool``):

``namespaces`` (root and a kernel that allows ``unshare``; these machines):
  ``unshare`` gives the call new mount, network, PID, IPC and UTS
  namespaces. Inside, ``sandbox_init`` (root, PID 1 of the new PID
  namespace) builds a new root from tmpfs holding only read-only bind mounts
  of the system directories and the interpreter's own prefixes (an
  allowlist: the run's files, ``/root``, ``/work``, ``/home`` and every other
  path simply do not exist in it), a fresh ``/proc``, a minimal ``/dev`` and
  a private, size-limited tmpfs ``/tmp`` (the working directory); its child
  chroots there and drops to an unprivileged uid of its own (one per
  concurrent call, so the per-uid process limit holds per call), with no
  capabilities and ``no_new_privs``. The new network namespace has only a
  loopback that is down: no connection leaves the call, not even to this
  host. PID 1 stays root and waits: when it dies, the kernel kills
  everything left in the namespace, however the code daemonised, so killing
  it (and ``unshare``, whose death sends it SIGKILL) ends the whole call.
  Every mount lives in the call's mount namespace and disappears with it.

``userns`` (not root, and the kernel allows unprivileged user namespaces):
  the same sandbox in a new *user* namespace first (``unshare --user
  --map-root-user``): the caller's own uid becomes root inside it, which is
  what mounting the new root needs, and nothing outside it. The program runs
  as that uid (the namespace maps no other, so there is no separate uid per
  call): on the host it is the orchestrator's own user, but in the private
  root it sees only the allowlist, holds no capability (bounding set emptied,
  ``no_new_privs``) and has no network, as above. ``max_processes`` counts
  the call's processes in its own user namespace (Linux counts a user's
  processes per user namespace), so it stays a per-call limit.

``process`` (fallback, e.g. namespaces forbidden in a container):
  the interpreter runs as the orchestrator's own user in a fresh temporary
  directory, in its own session, with the same rlimits; an audit hook
  (``sandbox_runner``) refuses sockets, process creation, signals, writes
  outside the directory and reads of protected paths. Much weaker: audit
  hooks are bypassed by ``ctypes`` or any C extension.

Either way the caller starts the process with ``start_new_session=True`` and
ends it with :func:`kill`, which SIGKILLs the whole process group (and the
namespace's PID 1) and waits until the namespace is gone.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import functools
import json
import os
import shutil
import signal
import site
import subprocess
import sys
import types
from typing import Any

from jax_dora.tools import sandbox_init, sandbox_runner

NAMESPACES = "namespaces"
USERNS = "userns"
PROCESS = "process"
ISOLATIONS = (NAMESPACES, USERNS, PROCESS)
# The isolations whose call runs under sandbox_init as PID 1 of new namespaces.
NAMESPACED = (NAMESPACES, USERNS)

SETUP_FAILED_EXIT_CODE = sandbox_init.SETUP_FAILED_EXIT_CODE
SETUP_FAILED = sandbox_init.SETUP_FAILED

# What every sandbox sees, read-only, when it exists on the host. No /etc:
# Python needs none of it (the loader's cache is the one file worth having).
SYSTEM_READONLY = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                   "/etc/ld.so.cache")

_COMMANDS = ("unshare",)


@dataclasses.dataclass(frozen=True)
class Limits:
  """Resource limits of one call (all per call; see DESIGN.md for what they bound).

  Attributes:
    wall_s: Wall-clock deadline, from the start of the process.
    cpu_s: CPU seconds per process (RLIMIT_CPU; SIGXCPU, then SIGKILL 1 s later).
    memory_bytes: Address space per process (RLIMIT_AS): a larger
      allocation raises MemoryError.
    max_processes: Processes and threads of the call's uid (RLIMIT_NPROC),
      enforced in ``namespaces`` only (the fallback forbids new processes).
    max_file_bytes: Largest file the code may write (RLIMIT_FSIZE).
    max_open_files: File descriptors per process (RLIMIT_NOFILE).
    tmp_bytes: Size of the private ``/tmp`` (``namespaces``); ``/dev/shm``
      gets the same.
  """

  wall_s: float = 10.0
  cpu_s: int = 10
  memory_bytes: int = 1 << 30
  max_processes: int = 32
  max_file_bytes: int = 16 << 20
  max_open_files: int = 64
  tmp_bytes: int = 64 << 20

  def __post_init__(self):
    for f in dataclasses.fields(self):
      if getattr(self, f.name) <= 0:
        raise ValueError(f"tool limit {f.name} must be > 0, got {getattr(self, f.name)}")

  def rlimits(self, isolation: str) -> dict[str, int]:
    """What ``sandbox_runner`` sets on itself."""
    out = {"cpu_s": self.cpu_s, "memory_bytes": self.memory_bytes,
           "max_file_bytes": self.max_file_bytes, "max_open_files": self.max_open_files}
    if isolation in NAMESPACED:
      out["max_processes"] = self.max_processes
    return out


@functools.cache
def source(module: types.ModuleType) -> str:
  """A stdlib-only module's code, read once, to pass with ``python -c``."""
  with open(module.__file__, encoding="utf-8") as f:
    return f.read()


def _inside(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip("/") + "/")


def interpreter_paths(python: str) -> list[str]:
  """Directories the interpreter needs beyond the system ones: its prefixes.

  For this process's own interpreter (the default), the virtual environment
  and the base installation; for another, the prefix above its ``bin/``
  before and after resolving links.
  """
  if os.path.realpath(python) == os.path.realpath(sys.executable):
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
  else:
    candidates = {os.path.dirname(os.path.dirname(os.path.abspath(python))),
                  os.path.dirname(os.path.dirname(os.path.realpath(python)))}
  out = []
  for c in sorted(os.path.realpath(c) for c in candidates):
    if c != "/" and not any(_inside(c, s) for s in SYSTEM_READONLY) and c not in out:
      out.append(c)
  return out


def readonly_paths(python: str, extra: tuple[str, ...] = ()) -> list[str]:
  """The allowlist bound read-only into the new root, existing paths only."""
  for e in extra:
    e = os.path.abspath(e)
    if e == "/" or _inside(e, "/proc") or _inside(e, "/dev"):
      raise ValueError(f"cannot expose {e} to the sandbox (it has its own /, /proc and /dev)")
    if not os.path.exists(e):
      raise ValueError(f"cannot expose {e} to the sandbox: it does not exist")
  paths = [p for p in SYSTEM_READONLY if os.path.lexists(p)]
  for p in interpreter_paths(python) + [os.path.abspath(e) for e in extra]:
    if os.path.exists(p) and p not in paths:
      paths.append(p)
  return paths


def namespace_prerequisites(isolation: str = NAMESPACES) -> str | None:
  """Why ``isolation`` (``namespaces`` or ``userns``) cannot work here, or None if it may.

  Only the cheap checks; the tool confirms with one real call.
  """
  if not sys.platform.startswith("linux"):
    return f"not Linux ({sys.platform})"
  if isolation == NAMESPACES and os.geteuid() != 0:
    return "not root (mounting and changing uid need it)"
  missing = [t for t in _COMMANDS if shutil.which(t) is None]
  if missing:
    return f"missing commands: {missing}"
  if not os.path.exists("/proc/self/ns/net"):
    return "no namespace support in /proc"
  if isolation == USERNS:
    try:
      with open("/proc/sys/user/max_user_namespaces", encoding="ascii") as f:
        if int(f.read()) <= 0:
          return "user namespaces are disabled (user.max_user_namespaces = 0)"
    except (OSError, ValueError):
      return "no /proc/sys/user/max_user_namespaces"
  return None


def site_paths(python: str) -> list[str]:
  """The interpreter's site-packages directories, as its ``site`` would add them.

  Why ask once, here: the program's interpreter starts with ``-S`` (no ``site``),
  and ``sandbox_runner`` appends these to ``sys.path`` itself. ``site`` also
  processes every ``.pth`` file in them, which in a development environment
  imports editable-install finders (``pathlib``, ``re``, ``urllib``): measured
  (2-core CPU, 12-07) 24.5 ms of CPU to start ``python -I -B`` in the project's
  venv against 8.1 ms with ``-S``, a third of a sandboxed call's CPU. Packages
  the program may import (numpy, sympy, ...) live in these directories and stay
  importable; what ``.pth`` files alone make visible (editable installs, legacy
  namespace packages) does not, and those live outside the sandbox's root anyway.
  """
  if os.path.realpath(python) == os.path.realpath(sys.executable):
    return [p for p in site.getsitepackages() if os.path.isdir(p)]
  try:
    out = subprocess.run([python, "-I", "-c", "import json, site;"
                          " print(json.dumps(site.getsitepackages()))"],
                         capture_output=True, text=True, timeout=60, check=True)
    paths = json.loads(out.stdout.strip().splitlines()[-1])
  except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
    detail = getattr(e, "stderr", None) or e
    raise ValueError(f"python tool: could not ask the interpreter {python!r} for its"
                     f" site-packages directories: {detail}") from e
  return [p for p in paths if isinstance(p, str) and os.path.isdir(p)]


def python_c(module: types.ModuleType, cfg: dict[str, Any]) -> list[str]:
  """``["-c", <module's source> + "sys.exit(main(<cfg as a literal>))"]``.

  The configuration travels as a Python literal (``repr`` of str/int/bool/list/
  dict/None values, all the host's own, never the model's) rather than JSON in
  ``argv``: parsing JSON imports ``json`` (and with it ``re`` and ``enum``),
  ~5 ms of CPU in each of the two interpreters every call starts.
  """
  literal = repr(cfg)
  try:
    same = ast.literal_eval(literal) == cfg
  except (ValueError, SyntaxError):  # e.g. an infinite limit: repr gives the name ``inf``
    same = False
  if not same:
    raise ValueError(f"sandbox configuration is not expressible as a Python literal: {literal}")
  return ["-c", f"{source(module)}\n\nsys.exit(main({literal}))\n"]


def runner_args(isolation: str, limits: Limits, workdir: str,
                protected: tuple[str, ...], packages: list[str]) -> list[str]:
  """``-c <sandbox_runner>(config)``; ``packages``: ``site_paths`` of the interpreter."""
  cfg = {"workdir": workdir, "limits": limits.rlimits(isolation),
         "guard": isolation == PROCESS, "protected": list(protected), "site_paths": packages}
  return python_c(sandbox_runner, cfg)


def namespace_argv(python: str, limits: Limits, uid: int, root: str, readonly: list[str],
                   protected: tuple[str, ...], token: str, packages: list[str],
                   user_namespace: bool = False) -> list[str]:
  """``unshare`` ... ``sandbox_init`` as PID 1 ... the interpreter, for one call.

  ``root`` is an empty host directory the new root is mounted on (inside the
  call's mount namespace only, so any number of calls share it); ``token``
  marks the setup's own failure messages (see ``sandbox_init``). With
  ``user_namespace`` (the ``userns`` isolation) the namespaces sit in a new
  user namespace where the caller is root, and the program keeps that single
  mapped uid (``uid`` is ignored).
  """
  hide = [os.path.abspath(p) for p in protected
          if any(_inside(os.path.abspath(p), r) for r in readonly)]
  cfg = {"root": root, "uid": 0 if user_namespace else uid, "change_uid": not user_namespace,
         "token": token, "size": limits.tmp_bytes, "readonly": readonly, "hide": hide,
         "argv": [python, "-I", "-S", "-B"] + runner_args(NAMESPACES, limits, sandbox_init.WORKDIR,
                                                          (), packages)}
  user = ["--user", "--map-root-user"] if user_namespace else []
  return [shutil.which("unshare"), *user, "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
          "--kill-child", "--propagation", "private", "--",
          python, "-I", "-S", "-B", *python_c(sandbox_init, cfg)]


def process_argv(python: str, limits: Limits, workdir: str,
                 protected: tuple[str, ...], packages: list[str]) -> list[str]:
  """The fallback: the interpreter itself, guarded by the runner's audit hook."""
  return [python, "-I", "-S", "-B"] + runner_args(PROCESS, limits, workdir, protected, packages)


def environment(home: str) -> dict[str, str]:
  """A minimal environment: none of the orchestrator's variables (secrets) leak in."""
  return {
      "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
      "HOME": home, "TMPDIR": home, "MPLCONFIGDIR": home,
      "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
      # One thread per numerical library: calls run in parallel already.
      "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
  }


def _child_pids(pid: int) -> list[int]:
  """Direct children of ``pid`` (the namespace's PID 1 for ``unshare --fork``)."""
  try:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
      return [int(x) for x in f.read().split()]
  except OSError:
    pass
  out = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[1]) == pid:
        out.append(int(entry))
  return out


def _signal(kill_fn, target: int) -> None:
  try:
    kill_fn(target, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def kill_now(proc: asyncio.subprocess.Process, isolation: str, wait_fds: bool = False) -> list[int]:
  """SIGKILLs the call's process group and, for the namespaced isolations, its PID 1.

  Synchronous (``close`` uses it too). With ``wait_fds``, returns pidfds of
  the namespace's PID 1 (opened before the signal, so its pid cannot be
  reused meanwhile) for the caller to wait on and close: the namespace is
  empty once it is gone.
  """
  fds = []
  if isolation in NAMESPACED:
    if proc.returncode is not None:
      return fds  # unshare waited for PID 1, whose exit emptied the namespace
    for child in _child_pids(proc.pid):
      if wait_fds:
        try:
          fds.append(os.pidfd_open(child))
        except OSError:
          continue  # already gone
      _signal(os.kill, child)
  _signal(os.killpg, proc.pid)  # start_new_session: pgid == pid
  return fds


async def _wait_readable(fd: int, timeout_s: float) -> bool:
  loop = asyncio.get_running_loop()
  done = loop.create_future()
  loop.add_reader(fd, lambda: done.done() or done.set_result(True))
  try:
    await asyncio.wait_for(done, timeout_s)
    return True
  except asyncio.TimeoutError:
    return False
  finally:
    loop.remove_reader(fd)


async def kill(proc: asyncio.subprocess.Process, isolation: str, timeout_s: float = 5.0) -> bool:
  """Kills the whole call and waits until nothing of it runs; False if that took too long."""
  fds = kill_now(proc, isolation, wait_fds=True)
  try:
    await asyncio.wait_for(proc.wait(), timeout_s)
    gone = True
    for fd in fds:
      gone = await _wait_readable(fd, timeout_s) and gone
    return gone
  except asyncio.TimeoutError:
    return False
  finally:
    for fd in fds:
      os.close(fd)
