"""Turns trajectories into bucketed fixed-shape training arrays.

Rows are padded to one of a few sequence-length buckets (``bucket_length``)
so the jitted train step compiles at most once per bucket, whatever mix of
short and long completions a step receives: long-tailed lengths must not
trigger recompiles, yet a batch of short answers should not pay for
``max_seq_len`` positions (the step's cost is linear in the padded length;
padding every batch to the longest possible sequence doubled it here).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_dora.types import Trajectory, no_route


def parse_buckets(spec: str, max_seq_len: int) -> tuple[int, ...]:
  """``"32,64"`` -> ``(32, 64, max_seq_len)``: sorted, capped, max always last."""
  out = set()
  for part in (x.strip() for x in spec.split(",")):
    if not part:
      continue
    n = int(part)
    if n < 2:
      raise ValueError(f"sequence-length bucket {n} must be >= 2")
    if n < max_seq_len:
      out.add(n)
  return tuple(sorted(out)) + (max_seq_len,)


def bucket_length(trajectories: Sequence[Trajectory], buckets: Sequence[int]) -> int:
  """The smallest bucket holding every ``prompt + completion`` row."""
  need = max(len(t.prompt_tokens) + len(t.completion_tokens) for t in trajectories)
  for b in buckets:
    if need <= b:
      return int(b)
  return int(buckets[-1])  # make_batch reports the overflow with the row's key


def make_batch(
    trajectories: Sequence[Trajectory],
    advantages: np.ndarray,
    seq_len: int,
    pad_id: int = 0,
    *,
    learner_version: int | None = None,
    mask_truncated: bool = False,
    routing: tuple[tuple[int, int], np.dtype] | None = None,
) -> dict[str, np.ndarray]:
  """Packs ``prompt + completion`` rows, right-padded to ``seq_len`` tokens.

  Row ``b`` of ``inputs`` is ``tokens[:-1]`` and of ``targets`` ``tokens[1:]``;
  ``mask`` marks the target positions that are completion tokens, and
  ``behaviour_logprobs`` is aligned with ``targets``. ``token_staleness`` is
  ``learner_version`` minus the version that sampled each token (from the
  trajectory's spans; zeros without a version): the loss splits its mismatch
  metrics by it and the log-linear proximal policy interpolates with it.

  ``mask_truncated`` (DAPO overlong filtering) zeroes the mask of rows that
  stopped at the length limit (``finish_reason == "length"``): a cut-off
  answer's reward says nothing about its reasoning, so its tokens take no
  gradient; the row still counts as trained (and in its group's advantages).

  Tool observations (``Trajectory.context_spans``) stay in the row as context
  the policy reads, with mask 0, behaviour log-prob 0 and staleness 0.

  ``routing``: an MoE policy's ``((moe_layers, k), dtype)`` (its
  ``learner.train_state.routing_spec``): the batch then has ``routing``
  ``[B, seq_len - 1, moe_layers, k]``, each input position's recorded
  experts (``Trajectory.routing``), the sentinel where there is none.
  """
  b = len(trajectories)
  if len(advantages) != b:
    raise ValueError(f"{b} trajectories but {len(advantages)} advantages")
  tokens = np.full((b, seq_len), pad_id, dtype=np.int32)
  mask = np.zeros((b, seq_len - 1), dtype=np.float32)
  blp = np.zeros((b, seq_len - 1), dtype=np.float32)
  stale = np.zeros((b, seq_len - 1), dtype=np.float32)
  routes = None
  if routing is not None:
    shape, dtype = routing
    routes = np.full((b, seq_len - 1) + tuple(shape), no_route(dtype), dtype)
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
    sampled = t.sampled_mask()  # tool observations are context, never trained
    if not (mask_truncated and t.finish_reason == "length"):
      mask[i, p - 1:p - 1 + c] = sampled
    blp[i, p - 1:p - 1 + c] = np.where(sampled, t.behaviour_logprobs, 0.0)
    if learner_version is not None and c:
      stale[i, p - 1:p - 1 + c] = np.where(sampled, learner_version - t.token_versions(), 0)
    if routes is not None and t.routing is not None:
      if t.routing.shape[1:] != routes.shape[2:] or len(t.routing) != p + c:
        raise ValueError(f"trajectory {t.key}: routing {list(t.routing.shape)} is not"
                         f" [{p + c}, {', '.join(map(str, routes.shape[2:]))}]")
      n = min(p + c, seq_len - 1)
      routes[i, :n] = t.routing[:n]
  positions = np.broadcast_to(np.arange(seq_len - 1, dtype=np.int32), (b, seq_len - 1)).copy()
  out = {
      "inputs": tokens[:, :-1],
      "targets": tokens[:, 1:],
      "positions": positions,
      "mask": mask,
      "behaviour_logprobs": blp,
      "advantages": np.asarray(advantages, dtype=np.float32),
      "token_staleness": stale,
  }
  if routes is not None:
    out["routing"] = routes
  return out
