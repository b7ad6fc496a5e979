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
  not the ones their publisher recorded checksums of (since each started);
  ``held_kv/*``: multi-turn next turns that prefilled only their new tokens
  on top of the held keys/values (``rollout/held_kv.py``) or re-prefilled.
  ``wire/*`` (remote servers): bytes of Generate traffic each way and how
  requests went out: in full, as a multi-turn delta, or again in full after a
  server lacked the delta's base (``rollout/wire_delta.py``).
  """

  def __init__(self):
    self._last: dict[str, tuple[float, dict[str, float]]] = {}
    self._last_wire: dict[str, dict[str, int]] = {}  # client-side counters, per client

  @staticmethod
  def _counters(st: Any) -> dict[str, float]:
    """A server's counters since it started (the records report their deltas)."""
    return {
        "busy": st.busy_time_s, "steps": st.decode_steps, "passes": st.decode_passes,
        "prefill_tokens": st.prefill_requested_tokens,
        "prefill_tokens_computed": st.prefill_computed_tokens,
        "reprefill_tokens": st.resumed_prefill_tokens,
        "held_kv/resumed_turns": st.held_kv_resumed,
        "held_kv/reprefilled_turns": sum(st.held_kv_fallbacks.values()),
        "held_kv/reused_tokens": st.held_kv_reused_tokens,
    }

  async def sample(self, clients: Sequence[Any]) -> dict[str, float | None]:
    ratios, refused = [], 0
    delta: dict[str, float] = {}
    fallbacks: dict[str, int] = {}
    for c in clients:
      wire_counters = getattr(c, "wire_counters", None)  # remote clients only
      if wire_counters is not None:
        cur_wire = {f"wire/{k}": v for k, v in wire_counters().items()}
        prev_wire = self._last_wire.get(c.name, dict.fromkeys(cur_wire, 0))
        self._last_wire[c.name] = cur_wire
        for key, value in cur_wire.items():
          delta[key] = delta.get(key, 0) + value - prev_wire.get(key, 0)
      try:
        st = await c.status()
      except Exception:  # pylint: disable=broad-exception-caught
        continue
      now = time.time()
      refused += st.snapshot_integrity_failures
      for why, n in st.held_kv_fallbacks.items():
        fallbacks[why] = fallbacks.get(why, 0) + n
      prev = self._last.get(c.name)
      cur = self._counters(st)
      self._last[c.name] = (now, cur)
      if prev is not None and now > prev[0]:
        ratios.append(1.0 - min(1.0, (cur["busy"] - prev[1]["busy"]) / (now - prev[0])))
        for key, value in cur.items():
          delta[key] = delta.get(key, 0) + max(0, value - prev[1][key])  # a restart starts at 0
    held_turns = delta.get("held_kv/resumed_turns", 0) + delta.get("held_kv/reprefilled_turns", 0)
    return {
        "rollout_idle_ratio": sum(ratios) / len(ratios) if ratios else None,
        "decode_passes_per_step": delta["passes"] / delta["steps"] if delta.get("steps") else None,
        "prefill_tokens": delta.get("prefill_tokens", 0),
        "prefill_tokens_computed": delta.get("prefill_tokens_computed", 0),
        "reprefill_tokens": delta.get("reprefill_tokens", 0),
        # Multi-turn: next turns since the last record that prefilled only their new tokens
        # (held KV) or their whole context again, and the context tokens not prefilled again.
        "held_kv/resumed_turns": delta.get("held_kv/resumed_turns", 0),
        "held_kv/reprefilled_turns": delta.get("held_kv/reprefilled_turns", 0),
        "held_kv/reused_tokens": delta.get("held_kv/reused_tokens", 0),
        "held_kv/reused_tokens_per_turn": (delta.get("held_kv/reused_tokens", 0) / held_turns
                                           if held_turns else None),
        "held_kv/reprefill_tokens_per_turn": (delta.get("reprefill_tokens", 0) / held_turns
                                              if held_turns else None),
        # Why held turns re-prefilled, since the servers started (held_kv.FALLBACKS).
        "held_kv/fallbacks_total": fallbacks,
        # Remote servers: Generate bytes each way since the last record, and requests sent
        # in full / as multi-turn deltas / in full again after a missing base.
        **{k: v for k, v in delta.items() if k.startswith("wire/")},
        # Snapshot loads the live servers refused: parameters not as published.
        "snapshot_integrity_failures_total": refused,
    }
