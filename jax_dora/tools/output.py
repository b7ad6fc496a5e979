"""Bounded capture of a tool's output: the head and the tail, never the middle.

A program may print gigabytes; the observation has a budget of a few
kilobytes and the orchestrator's memory must not grow with what the code
prints. The capture keeps the first half of the budget and a rolling window
of the last half (where a final answer or a traceback is), counts the rest,
and says in the observation how much it left out.
"""

from __future__ import annotations


class BoundedOutput:
  """Accumulates chunks, keeping at most ``max_bytes`` of them.

  Args:
    max_bytes: Budget of the kept output (head + tail), > 0.
  """

  def __init__(self, max_bytes: int):
    if max_bytes <= 0:
      raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    self.max_bytes = int(max_bytes)
    self._head_cap = self.max_bytes - self.max_bytes // 2
    self._tail_cap = self.max_bytes // 2
    self._head = bytearray()
    self._tail = bytearray()
    self.total = 0

  def add(self, chunk: bytes) -> None:
    self.total += len(chunk)
    room = self._head_cap - len(self._head)
    if room > 0:
      self._head += chunk[:room]
      chunk = chunk[room:]
    if chunk and self._tail_cap:
      self._tail += chunk[-self._tail_cap:]
      del self._tail[:-self._tail_cap]

  @property
  def truncated(self) -> bool:
    return self.total > len(self._head) + len(self._tail)

  def text(self) -> str:
    """The kept output, with a note where the middle was left out."""
    head = self._head.decode("utf-8", errors="replace")
    if not self.truncated:
      return head + self._tail.decode("utf-8", errors="replace")
    omitted = self.total - len(self._head) - len(self._tail)
    tail = self._tail.decode("utf-8", errors="replace")
    return (f"{head}\n[output truncated: {omitted} of {self.total} bytes omitted]\n{tail}")
