"""What a run reports about itself: per-step log lines and rollout-server telemetry."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def log_line(rec: dict[str, Any]) -> str:
  """One readable line per logged step (for runs read from a log file)."""
  beh = rec.get("staleness_behaviour") or {}
  parts = [
      f"step {rec['step']}",
      f"reward {rec['reward_mean']:.3f}",
      f"len {rec['completion_len_mean']:.0f}",
      f"loss {rec.get('train/loss', float('nan')):.4f}",
      f"bubble {rec['bubble_ratio']:.2f}",
      f"{rec['trained_tokens_per_s']:.0f} tok/s",
      f"staleness mean {beh.get('mean') or 0:.2f} max {beh.get('max') or 0}",
      f"pool {rec['pool_groups']}",
  ]
  kl = rec.get("train/mismatch/kl_k3")
  if kl is not None:
    # Learner vs behaviour log-probs: 0 on-policy; grows with staleness.
    parts.append(f"mismatch kl {kl:.1e}")
  if rec.get("eval_reward") is not None:
    parts.append(f"eval {rec['eval_reward']:.3f}")
  return " | ".join(parts)


class RolloutTelemetry:
  """Rollout idle share and decode passes per step, as deltas between samples.

  ``rollout_idle_ratio`` = 1 - busy share of the servers' wall time;
  ``decode_passes_per_step`` = live versions per decode step (1.0 = no
  multi-version overhead; each extra held-and-pinned version costs a pass).
  ``prefill_tokens`` / ``prefill_tokens_computed``: context tokens admitted
  and actually computed (group prefix sharing makes the second smaller);
  ``reprefill_tokens``: the resumed part of contexts, i.e. completions of
  interrupted rollouts prefilled again (AReaL-style interruption pays this
  after every publish, DORA does not); ``snapshot_integrity_failures_total``:
  snapshot loads the servers refused because the restored parameters were
  not the ones their publisher recorded checksums of (since each started).
  """

  def __init__(self):
    self._last: dict[str, tuple[float, float, int, int, int, int, int]] = {}

  async def sample(self, clients: Sequence[Any]) -> dict[str, float | None]:
    ratios, steps, passes, refused = [], 0, 0, 0
    prefill = [0, 0, 0]
    for c in clients:
      try:
        st = await c.status()
      except Exception:  # pylint: disable=broad-exception-caught
        continue
      now = time.time()
      refused += st.snapshot_integrity_failures
      prev = self._last.get(c.name)
      cur = (now, st.busy_time_s, st.decode_steps, st.decode_passes,
             st.prefill_requested_tokens, st.prefill_computed_tokens, st.resumed_prefill_tokens)
      self._last[c.name] = cur
      if prev is not None and now > prev[0]:
        ratios.append(1.0 - min(1.0, (st.busy_time_s - prev[1]) / (now - prev[0])))
        steps += st.decode_steps - prev[2]
        passes += st.decode_passes - prev[3]
        for i in range(3):
          prefill[i] += max(0, cur[4 + i] - prev[4 + i])  # a restarted server starts at 0
    return {
        "rollout_idle_ratio": sum(ratios) / len(ratios) if ratios else None,
        "decode_passes_per_step": passes / steps if steps else None,
        "prefill_tokens": prefill[0],
        "prefill_tokens_computed": prefill[1],
        "reprefill_tokens": prefill[2],
        # Snapshot loads the live servers refused: parameters not as published.
        "snapshot_integrity_failures_total": refused,
    }
