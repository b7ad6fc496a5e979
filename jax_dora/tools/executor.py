"""Runs tool calls from many trajectories at once, and counts what happened.

The orchestrator awaits :meth:`ToolExecutor.call` from every trajectory that
stopped at a tool call. Calls run in parallel up to ``max_concurrency`` (an
``asyncio.Semaphore``: the rest queue without blocking the event loop); a
call's result is always a :class:`~jax_dora.tools.base.ToolResult`, never an
exception, so one trajectory's hostile code cannot stop the run. Counters
(:meth:`metrics`, the ``tools/*`` keys of the metrics stream) say how many
calls timed out, ran out of memory, failed, were truncated, and how long
they took, the way ``RewardScorer.metrics`` does for rewards.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Iterable
from typing import Any

from jax_dora.tools import builtin  # noqa: F401  (fills TOOLS)  pylint: disable=unused-import
from jax_dora.tools.base import (ERROR, KILLED, MEMORY, OK, SANDBOX_ERROR, TIMEOUT, Tool,
                                 ToolCall, ToolResult, make_tool)

_log = logging.getLogger(__name__)
# A modelled latency is cut at this many times its mean (an environment's own timeout).
LATENCY_CAP = 20.0
_MAX_WARNINGS = 5

# status -> counter name under tools/.
_COUNTER = {OK: "ok", ERROR: "errors", TIMEOUT: "timeouts", MEMORY: "memory_errors",
            KILLED: "killed", SANDBOX_ERROR: "sandbox_errors"}


class ToolExecutor:
  """Tool calls by name, bounded in concurrency, with counters.

  Args:
    tools: Registered tool names to enable, or ready tool instances.
    max_concurrency: Calls running at once across all tools; more wait.
    extra_latency_s: Added to every call after it finished and released its
      slot, to model a slower environment (a remote sandbox) in experiments.
    latency_tail_alpha: 0: every call waits ``extra_latency_s``. > 1: each
      call waits a Pareto draw of that tail exponent whose mean is
      ``extra_latency_s``, cut at ``LATENCY_CAP`` times the mean: environment
      latencies are long-tailed (a cold sandbox, a slow web page, code that
      runs to its timeout), and the slowest call of a batch is what a
      synchronous step waits for.
    seed: Seeds the latency draws.
    options: Per tool name, keyword arguments of its constructor (e.g.
      ``{"python": {"limits": Limits(wall_s=5)}}``).
  """

  def __init__(
      self,
      tools: Iterable[str | Tool] = ("python",),
      max_concurrency: int = 8,
      extra_latency_s: float = 0.0,
      options: dict[str, dict[str, Any]] | None = None,
      latency_tail_alpha: float = 0.0,
      seed: int = 0,
  ):
    if max_concurrency < 1:
      raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if extra_latency_s < 0:
      raise ValueError(f"extra_latency_s must be >= 0, got {extra_latency_s}")
    if latency_tail_alpha and latency_tail_alpha <= 1:
      raise ValueError(f"latency_tail_alpha must be 0 or > 1 (a finite mean), got"
                       f" {latency_tail_alpha}")
    options = options or {}
    self.tools: dict[str, Tool] = {}
    for t in tools:
      tool = make_tool(t, **options.get(t, {})) if isinstance(t, str) else t
      self.tools[tool.name] = tool
    self.max_concurrency = int(max_concurrency)
    self.extra_latency_s = float(extra_latency_s)
    self.latency_tail_alpha = float(latency_tail_alpha)
    self._latency_rng = random.Random(seed)
    self.extra_latency_total_s = 0.0
    self.stats: collections.Counter[str] = collections.Counter()
    self.wall_s_total = 0.0
    self._semaphore: asyncio.Semaphore | None = None
    self._in_flight = 0

  async def call(self, call: ToolCall) -> ToolResult:
    """Runs one call; never raises for the call's own failures."""
    self.stats["calls"] += 1
    tool = self.tools.get(call.tool)
    if tool is None:
      result = ToolResult(f"[error: unknown tool {call.tool!r}; available: {sorted(self.tools)}]",
                          ERROR)
      self.stats["unknown_tool"] += 1
    else:
      if self._semaphore is None:
        self._semaphore = asyncio.Semaphore(self.max_concurrency)
      async with self._semaphore:
        self._in_flight += 1
        try:
          result = await tool.run(call)
        except Exception as e:  # pylint: disable=broad-exception-caught
          _log.exception("tool %s raised on call %s", call.tool, call.call_id)
          result = ToolResult(f"[sandbox error: {type(e).__name__}: {e}]", SANDBOX_ERROR)
        finally:
          self._in_flight -= 1
    self._count(call, result)
    wait = self.draw_latency()
    if wait:
      self.extra_latency_total_s += wait
      await asyncio.sleep(wait)
    return result

  def draw_latency(self) -> float:
    """The modelled environment latency of one call (see the class doc)."""
    if not self.extra_latency_s or not self.latency_tail_alpha:
      return self.extra_latency_s
    a = self.latency_tail_alpha
    scale = self.extra_latency_s * (a - 1) / a  # Pareto(scale, a) has mean extra_latency_s
    u = self._latency_rng.random()
    return min(scale / (1.0 - u) ** (1.0 / a), LATENCY_CAP * self.extra_latency_s)

  async def call_many(self, calls: Iterable[ToolCall]) -> list[ToolResult]:
    """Many calls at once (up to the concurrency limit), results in order."""
    return list(await asyncio.gather(*(self.call(c) for c in calls)))

  def _count(self, call: ToolCall, result: ToolResult) -> None:
    key = _COUNTER[result.status]
    self.stats[key] += 1
    if result.truncated:
      self.stats["truncated"] += 1
    self.wall_s_total += result.wall_s
    if result.status == SANDBOX_ERROR and self.stats[key] <= _MAX_WARNINGS:
      _log.warning("tool %s could not run call %s: %s", call.tool, call.call_id,
                   result.observation[:300])

  def metrics(self) -> dict[str, float]:
    """Cumulative counters: ``tools/calls``, ``tools/timeouts``, ``tools/errors``, ...

    Every key is always present (zeros included), so a dashboard's series
    exist from the first step.
    """
    out: dict[str, float] = {"tools/calls": self.stats["calls"]}
    for key in sorted(set(_COUNTER.values()) | {"truncated", "unknown_tool"}):
      out[f"tools/{key}"] = self.stats[key]
    out["tools/wall_s_total"] = round(self.wall_s_total, 6)
    out["tools/extra_latency_s_total"] = round(self.extra_latency_total_s, 6)
    out["tools/in_flight"] = self._in_flight
    return out

  def close(self) -> None:
    """Kills every call still running (they return killed results) and closes the tools."""
    for tool in self.tools.values():
      tool.close()

  def __enter__(self) -> "ToolExecutor":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
