"""PID 1 of a sandbox's namespaces: builds its root, starts the program, waits.

Runs as root inside the new mount, network, PID, IPC and UTS namespaces that
``unshare`` made (``sandbox.namespace_argv``), from source passed with
``python -I -S -B -c``, so it imports only the standard library (its
configuration is a Python literal appended to that source: no ``json`` import). One process
doing the mounts with ``mount(2)`` through ctypes costs one interpreter
start; the shell script it replaced forked ``mount``/``mkdir`` some 25 times
and tripled the per-call overhead.

Steps: a tmpfs root on the (empty, host-created) mount point; a fresh
``/proc``; a ``/dev`` with only null, zero, full, random and urandom;
size-limited tmpfs ``/dev/shm`` and ``/tmp`` (holding the program's working
directory, owned by the call's uid, where ``main.py`` is written from
stdin); read-only, nosuid, nodev bind mounts of the allowlisted host paths
at their own paths; empty read-only covers over protected paths inside
them; the root and ``/dev`` remounted read-only. Then a child chroots, drops every capability
from its bounding set, sets ``no_new_privs``, changes to the call's uid and
gid with no supplementary groups, and execs the interpreter; this process
stays root and waits, reaping orphans. When it exits, the kernel kills
whatever is left in the PID namespace, and every mount goes with the mount
namespace. It exits with the program's exit code, or 128 + N for a program
killed by signal N, or :data:`SETUP_FAILED_EXIT_CODE` with a message that
starts with ``sandbox setup failed [token]`` if it could not build the
sandbox. The token is the host's, per call, and invisible to the program:
a program cannot pass its own failure off as the sandbox's (an RL policy
could learn to, if the orchestrator treats sandbox errors differently).
"""

from __future__ import annotations

import ctypes
import os
import sys

SETUP_FAILED_EXIT_CODE = 125
SETUP_FAILED = "sandbox setup failed"

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND = 32, 4096
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
_DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)
WORKDIR = "/tmp/work"  # the program's working directory inside the sandbox


def _b(s: str | None) -> bytes | None:
  return None if s is None else os.fsencode(s)


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
  if _libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _bind_readonly(source: str, target: str) -> None:
  _mount(source, target, None, MS_BIND)
  _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _touch(path: str) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb"):
    pass


def build_root(root: str, uid: int, size: int, readonly: list[str], hide: list[str],
               code: bytes) -> None:
  """Populates the new root at ``root`` (see the module docstring)."""
  os.umask(0o022)
  _mount("jd-root", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
  os.mkdir(root + "/proc")
  # hidepid=2: the program cannot see this process (root), so not its
  # command line and the token in it.
  _mount("jd-proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
  dev = root + "/dev"
  os.mkdir(dev)
  _mount("jd-dev", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
  for d in _DEVICES:
    _touch(f"{dev}/{d}")
    _mount(f"/dev/{d}", f"{dev}/{d}", None, MS_BIND)
  os.symlink("/proc/self/fd", dev + "/fd")
  os.mkdir(dev + "/shm")
  _mount("jd-shm", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
  os.mkdir(root + "/tmp")
  _mount("jd-tmp", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
         f"size={size},mode=0700,uid={uid},gid={uid}")
  # The program's working directory: its own directory inside /tmp, so that
  # read-only paths allowlisted under the host's /tmp (a venv in /tmp/x) are
  # not listed in it.
  os.mkdir(root + WORKDIR, 0o700)
  os.chown(root + WORKDIR, uid, uid)
  with open(root + WORKDIR + "/main.py", "wb") as f:
    f.write(code)
  # After /tmp: an allowlisted path under the host's /tmp appears, read-only,
  # inside the private one.
  for p in readonly:
    target = root + p
    if os.path.islink(p):
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.symlink(os.readlink(p), target)
    elif os.path.isdir(p):
      os.makedirs(target, exist_ok=True)
      _bind_readonly(p, target)
    elif os.path.exists(p):
      _touch(target)
      _bind_readonly(p, target)
  for p in hide:
    target = root + p
    if os.path.isdir(target):
      _mount("jd-hidden", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0")
    elif os.path.exists(target):
      _bind_readonly("/dev/null", target)
  _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
  _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _drop_privileges(uid: int, change_uid: bool = True) -> None:
  """No capabilities (bounding set emptied first: that needs CAP_SETPCAP), no
  way to regain any (``no_new_privs``), then an unprivileged uid and gid.

  In a user namespace (``change_uid`` false) the only mapped uid is the
  caller's, so the program keeps it: changing the uid (even to itself) drops
  every effective capability, and ``setgroups`` is denied there anyway.
  """
  with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
    last = int(f.read())
  for cap in range(last + 1):
    _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
  if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
  if not change_uid:
    _clear_capabilities()
    return
  os.setgroups([])
  os.setresgid(uid, uid, uid)
  os.setresuid(uid, uid, uid)
  if os.getuid() != uid or os.geteuid() != uid:
    raise OSError("the uid did not change")


class _CapHeader(ctypes.Structure):
  _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
  _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
              ("inheritable", ctypes.c_uint32)]


def _clear_capabilities() -> None:
  """Empties the effective, permitted and inheritable sets (``capset``). Without a uid
  change nothing else clears them, and an exec as (namespace) root grants the
  permitted set from the bounding set (emptied) *and* the inheritable set."""
  header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
  data = (_CapData * 2)()
  if _libc.capset(ctypes.byref(header), data) != 0:
    raise OSError(ctypes.get_errno(), "capset")


def _fail(token: str, what: str) -> None:
  print(f"{SETUP_FAILED} [{token}]: {what}", file=sys.stderr, flush=True)


def _start(root: str, uid: int, argv: list[str], token: str, change_uid: bool = True) -> int:
  """Forks the program's process: chroot, drop privileges, exec."""
  pid = os.fork()
  if pid:
    return pid
  try:
    os.chroot(root)
    os.chdir(WORKDIR)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _drop_privileges(uid, change_uid)
    os.execv(argv[0], argv)
  except BaseException as e:  # pylint: disable=broad-exception-caught
    _fail(token, f"{type(e).__name__}: {e}")
  os._exit(SETUP_FAILED_EXIT_CODE)


def main(cfg: dict) -> int:
  """``cfg``: what ``sandbox.namespace_argv`` wrote as a literal after this source."""
  code = sys.stdin.buffer.read()
  try:
    build_root(cfg["root"], cfg["uid"], cfg["size"], cfg["readonly"], cfg["hide"], code)
  except OSError as e:
    _fail(cfg["token"], str(e))
    return SETUP_FAILED_EXIT_CODE
  child = _start(cfg["root"], cfg["uid"], cfg["argv"], cfg["token"], cfg["change_uid"])
  while True:  # PID 1 inherits every orphan: reap them until the program ends
    pid, status = os.waitpid(-1, 0)
    if pid == child:
      return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

