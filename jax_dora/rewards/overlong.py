"""DAPO's soft overlong punishment (``reward.overlong_buffer``).

A completion that hits the length limit is usually unfinished reasoning; a
hard -1 at the limit is a cliff the policy cannot see coming. DAPO instead
adds a penalty that grows linearly over the last ``buffer`` tokens of the
budget, so the policy feels the limit before it is cut off.
"""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float = 1.0) -> float:
  """``0`` up to ``max_length - buffer`` tokens, then down to ``-penalty`` at ``max_length``.

  ``(max_length - buffer - length) / buffer * penalty`` inside the buffer and
  ``-penalty`` beyond the limit; ``buffer = 0`` turns it off.
  """
  if buffer <= 0:
    return 0.0
  start = max_length - buffer
  if length <= start:
    return 0.0
  if length > max_length:
    return -float(penalty)
  return (start - length) / buffer * float(penalty)
