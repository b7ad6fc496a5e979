"""Quiet start-up: the heavy imports that may print C++ noise happen here, captured.

JetStream's engine API used to import seqio and with it TensorFlow, whose
CUDA stubs wrote "Could not find cuda drivers" and absl pre-init warnings
straight to file descriptor 2 (``TF_CPP_MIN_LOG_LEVEL`` no longer silences
them). ``jax_dora.jetstream_api`` now keeps TensorFlow out entirely; the
command-line entry points still import it (and anything that might log from
C++ at import) once, early, with descriptor 2 pointed at a temporary file,
so a user's first screen stays the progress bar. The captured text is shown
only if the import fails (or with ``--verbosity`` >= 1, when nothing is
captured). Later imports of the same modules are free and silent.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from collections.abc import Iterator

# How jax_dora.rollout.engine and jax_dora.model.tokenizer reach JetStream.
NOISY_MODULES = ("jax_dora.jetstream_api",)


@contextlib.contextmanager
def captured_stderr_fd() -> Iterator[None]:
  """Redirects file descriptor 2 (C++ logging included) into a temporary file.

  On an exception the captured text is written back to stderr before the
  exception propagates, so a failing import still explains itself.
  """
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      tmp.seek(0)
      sys.stderr.write(tmp.read().decode(errors="replace"))
      raise
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)


def quiet_startup(verbose: bool = False) -> None:
  """Imports :data:`NOISY_MODULES` silently (normally when ``verbose``)."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  todo = [m for m in NOISY_MODULES if m not in sys.modules]
  if not todo:
    return
  ctx = contextlib.nullcontext() if verbose else captured_stderr_fd()
  with ctx:
    for m in todo:
      importlib.import_module(m)
