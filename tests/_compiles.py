"""Counts XLA backend compiles (``jax.monitoring``), to test ahead-of-time warmup."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

# Emitted by JAX for every real XLA compile (not for compilation-cache hits).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles() -> Iterator[list[str]]:
  """Yields a list that receives one entry per backend compile inside the block."""
  seen: list[str] = []

  def listener(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    if event == BACKEND_COMPILE_EVENT:
      seen.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
