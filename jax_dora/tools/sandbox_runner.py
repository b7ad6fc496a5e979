"""The first code that runs inside a sandbox, before the model's program.

Its source is passed to the sandbox interpreter with ``python -I -S -B -c``,
its configuration appended as a Python literal, so it must import nothing but
the standard library (the sandbox sees no ``jax_dora``), and imports little of
that: every import is paid by every tool call (``sandbox.site_paths``). It lowers the resource limits on itself (they are inherited
by anything the program starts, and lowering needs no privilege), then runs
``main.py`` from the working directory as ``__main__`` with tracebacks that
start at the program's own frames (the model should not read about this
runner). Limits are set here rather than in a ``preexec_fn`` because the
orchestrator process has threads (JAX's), where ``preexec_fn`` is unsafe.

A ``MemoryError`` the program does not catch exits with
:data:`MEMORY_EXIT_CODE`, so the host can name the failure without parsing
the traceback (a program that exits with that code on purpose only
mislabels its own result).

With ``guard`` set (the fallback when the OS sandbox is unavailable), an
audit hook also refuses sockets, new processes, signals to other processes,
writes outside the working directory and reads of protected paths. Audit
hooks are a speed bump, not a boundary: ``ctypes`` or a C extension gets
around them.
"""

from __future__ import annotations

import os
import resource
import sys

MEMORY_EXIT_CODE = 121
MAIN = "main.py"

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PROCESS_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
    "subprocess.Popen", "pty.spawn",
})
_NET_EVENTS = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"})
# event -> indices of path arguments that are written to.
_WRITE_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
    "os.link": (0, 1), "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,),
    "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "os.chflags": (0,),
    "os.setxattr": (0,), "os.removexattr": (0,),
}
_READ_EVENTS = {"os.listdir": (0,), "os.scandir": (0,), "os.getxattr": (0,), "os.listxattr": (0,)}


def _set_limits(limits: dict[str, int]) -> None:
  """Lowers this process's rlimits; ``cpu_s`` gets a 1 s grace between SIGXCPU and SIGKILL."""
  pairs = {
      "cpu_s": (resource.RLIMIT_CPU, 1),
      "memory_bytes": (resource.RLIMIT_AS, 0),
      "max_processes": (resource.RLIMIT_NPROC, 0),
      "max_file_bytes": (resource.RLIMIT_FSIZE, 0),
      "max_open_files": (resource.RLIMIT_NOFILE, 0),
  }
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  for key, (which, grace) in pairs.items():
    value = limits.get(key)
    if value is not None:
      resource.setrlimit(which, (int(value), int(value) + grace))


def _install_guard(workdir: str, protected: list[str]) -> None:
  """The fallback's audit hook (see the module docstring for what it is worth)."""
  real = os.path.realpath
  work = real(workdir)
  own_proc = f"/proc/{os.getpid()}"
  # /proc of other processes holds their environments (secrets) and this
  # process runs as the orchestrator's user in the fallback.
  hidden = [real(p) for p in protected] + ["/proc"]

  def inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)

  def check(path, write: bool) -> None:
    if path is None or isinstance(path, int):
      return
    shown = os.fsdecode(path)
    resolved = real(shown)
    if any(inside(resolved, h) for h in hidden) and not inside(resolved, own_proc) \
        and resolved != "/proc/self":
      raise PermissionError(f"sandbox: {shown} is not accessible")
    if write and not inside(resolved, work):
      raise PermissionError(f"sandbox: cannot write outside the working directory: {shown}")

  def hook(event: str, args: tuple) -> None:
    if event == "open":
      path, mode, flags = args
      write = bool((flags or 0) & _WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")
      check(path, write)
    elif event in _WRITE_EVENTS:
      for i in _WRITE_EVENTS[event]:
        check(args[i], True)
    elif event in _READ_EVENTS:
      for i in _READ_EVENTS[event]:
        check(args[i] if args else ".", False)
    elif event in _PROCESS_EVENTS:
      raise PermissionError("sandbox: starting processes is not allowed")
    elif event in ("os.kill", "os.killpg") and args[0] not in (0, os.getpid()):
      raise PermissionError("sandbox: signalling other processes is not allowed")
    elif event == "socket.__new__" and args[1] != 1:  # AF_UNIX stays (socketpair)
      raise PermissionError("sandbox: the network is not available")
    elif event in _NET_EVENTS:
      raise PermissionError("sandbox: the network is not available")

  sys.addaudithook(hook)


def _add_site(paths: list[str]) -> None:
  """What ``site`` gives a program, without its ``.pth`` processing (the interpreter runs
  with ``-S``; ``sandbox.site_paths`` says why): the site-packages directories on
  ``sys.path`` and the builtins ``exit``, ``quit``, ``help``, ``copyright``, ``credits``
  and ``license`` that programs call. ``import site`` under ``-S`` changes nothing by
  itself."""
  import site  # pylint: disable=import-outside-toplevel
  site.setquit()
  site.setcopyright()
  site.sethelper()
  sys.path.extend(p for p in paths if p not in sys.path)


def _print_exception(exc: BaseException) -> None:
  """The traceback without this runner's frame (the program's own frames only)."""
  import traceback  # pylint: disable=import-outside-toplevel  (only programs that fail pay it)
  tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
  traceback.print_exception(type(exc), exc, tb)


def main(spec: dict) -> int:
  """``spec``: what ``sandbox.runner_args`` wrote as a literal after this source."""
  workdir = spec["workdir"]
  os.chdir(workdir)
  with open(MAIN, encoding="utf-8", errors="replace") as f:
    source = f.read()
  sys.argv = [MAIN]
  sys.path.insert(0, workdir)
  _add_site(spec.get("site_paths", []))
  # Line-buffered, so what was printed before a timeout's SIGKILL is seen.
  for stream in (sys.stdout, sys.stderr):
    stream.reconfigure(encoding="utf-8", errors="backslashreplace", line_buffering=True)
  _set_limits(spec["limits"])
  if spec.get("guard"):
    _install_guard(workdir, spec.get("protected", []))
  try:
    code = compile(source, MAIN, "exec")
  except (SyntaxError, ValueError) as e:
    import traceback  # pylint: disable=import-outside-toplevel
    traceback.print_exception(type(e), e, None)
    return 1
  namespace = {"__name__": "__main__", "__file__": os.path.join(workdir, MAIN),
               "__builtins__": __builtins__}
  try:
    exec(code, namespace)  # pylint: disable=exec-used
  except SystemExit:
    raise
  except MemoryError as e:
    _print_exception(e)
    return MEMORY_EXIT_CODE
  except BaseException as e:  # pylint: disable=broad-exception-caught
    _print_exception(e)
    return 1
  return 0

