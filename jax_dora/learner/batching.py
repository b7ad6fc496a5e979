"""Turns trajectories into fixed-shape training arrays.

Shapes are fixed (``[batch, max_seq_len - 1]``) so the jitted train step
compiles once per run, whatever mix of short and long completions a step
receives: long-tailed lengths must not trigger recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_dora.types import Trajectory


def make_batch(
    trajectories: Sequence[Trajectory],
    advantages: np.ndarray,
    seq_len: int,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
  """Packs ``prompt + completion`` rows, right-padded to ``seq_len`` tokens.

  Row ``b`` of ``inputs`` is ``tokens[:-1]`` and of ``targets`` ``tokens[1:]``;
  ``mask`` marks the target positions that are completion tokens, and
  ``behaviour_logprobs`` is aligned with ``targets``.
  """
  b = len(trajectories)
  if len(advantages) != b:
    raise ValueError(f"{b} trajectories but {len(advantages)} advantages")
  tokens = np.full((b, seq_len), pad_id, dtype=np.int32)
  mask = np.zeros((b, seq_len - 1), dtype=np.float32)
  blp = np.zeros((b, seq_len - 1), dtype=np.float32)
  for i, t in enumerate(trajectories):
    p = len(t.prompt_tokens)
    c = len(t.completion_tokens)
    if p + c > seq_len:
      raise ValueError(
          f"trajectory {t.key}: prompt {p} + completion {c} tokens exceed"
          f" seq_len {seq_len}"
      )
    if len(t.behaviour_logprobs) != c:
      raise ValueError(f"trajectory {t.key}: {c} tokens but {len(t.behaviour_logprobs)} logprobs")
    tokens[i, :p] = t.prompt_tokens
    tokens[i, p:p + c] = t.completion_tokens
    # Completion token j sits at position p + j and is predicted at p + j - 1.
    mask[i, p - 1:p - 1 + c] = 1.0
    blp[i, p - 1:p - 1 + c] = t.behaviour_logprobs
  positions = np.broadcast_to(np.arange(seq_len - 1, dtype=np.int32), (b, seq_len - 1)).copy()
  return {
      "inputs": tokens[:, :-1],
      "targets": tokens[:, 1:],
      "positions": positions,
      "mask": mask,
      "behaviour_logprobs": blp,
      "advantages": np.asarray(advantages, dtype=np.float32),
  }
