"""Process helpers the benchmarks share (tests have theirs in tests/_harness.py)."""

from __future__ import annotations

import socket


def free_port() -> int:
  """A TCP port free on the loopback right now (for a rollout server subprocess)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
