"""JAX's persistent compilation cache, on by default for the command-line entry points.

A run compiles the same programs every time it starts (the learner's init and
train step per length bucket, the rollout servers' prefill and decode steps):
on an accelerator that is most of the start-up (the 0.5B train step alone
compiles for ~40 s). With the cache, the first start writes every executable
to ``compile_cache_dir`` and later starts of the same programs load them
instead. The key covers the program, its shardings, the compiler flags and the
jax/XLA version, so a changed model, config or install compiles afresh (and
adds entries); nothing stale is ever loaded.

``compile_cache_dir`` (the run config's key):

* ``"auto"`` (default): ``$JAX_COMPILATION_CACHE_DIR`` when set (JAX's own
  variable; the tests and ``benchmarks/modes.py`` point it at their own
  directories), else ``$XDG_CACHE_HOME/jax_dora/xla`` (``~/.cache/jax_dora/xla``).
* a path: that directory (``~`` expanded; a ``gs://`` path works where
  ``etils[epath]`` can reach it, e.g. one cache shared by a pod's hosts).
* ``""``: off.

Set up by ``jax_dora.train``, ``jax_dora.rollout.server_main`` and
``jax_dora.evaluate`` before their first compile; library users (notebooks,
tests calling ``run_training``) opt in with :func:`setup_compile_cache`.
Every compile is cached, however quick (JAX's default skips those under a
second): the many sub-second programs of a start-up add up to more than the
big one, and a load is milliseconds. The directory is kept under
``MAX_CACHE_BYTES`` by evicting the least recently used entries (when the
``filelock`` package is installed, as it is with ``huggingface_hub``;
otherwise it grows until deleted).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import jax

AUTO = "auto"
# Least-recently-used entries beyond this are evicted (when filelock exists).
MAX_CACHE_BYTES = 16 * 2**30

_log = logging.getLogger(__name__)


def default_cache_dir() -> str:
  """``$XDG_CACHE_HOME/jax_dora/xla``, ``~/.cache/jax_dora/xla`` without XDG."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jax_dora", "xla")


def resolve_cache_dir(setting: str | None) -> str | None:
  """The directory ``compile_cache_dir=setting`` names; ``None`` when the cache is off."""
  setting = AUTO if setting is None else str(setting).strip()
  if not setting:
    return None
  if setting == AUTO:
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_cache_dir()
  return setting if "://" in setting else os.path.abspath(os.path.expanduser(setting))


def setup_compile_cache(setting: str | None = AUTO) -> str | None:
  """Turns the persistent cache on for this process; returns its directory (None: off).

  Call before the first compile that should be cached (programs compiled
  earlier are simply not cached). A directory that cannot be created turns
  the cache off with a warning: a read-only home must not stop a run.
  """
  path = resolve_cache_dir(setting)
  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  if "://" not in path:
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      _log.warning("compile cache off: cannot create %s (%s)", path, e)
      jax.config.update("jax_enable_compilation_cache", False)
      return None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if importlib.util.find_spec("filelock") is not None:
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
  _log.info("persistent compilation cache: %s", path)
  return path
