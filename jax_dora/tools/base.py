"""The tool contract: what a call carries, what it returns, and the registry.

A multi-turn rollout stops generation at a tool call, runs the tool and
appends its observation to the context before generating again. The
orchestrator only ever sees :class:`ToolCall` in and :class:`ToolResult` out,
so a tool's failure (a timeout, a memory error, a crash of the sandbox
itself) is a *result* with a status and a readable observation, never an
exception: the trajectory goes on, the model sees what went wrong, and the
executor counts it.

Tools are chosen by name (``TOOLS``); adding one is one module with a class
implementing :class:`Tool`, a ``TOOLS.register(name, cls)`` line in it, and
its import in ``jax_dora.tools.builtin``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from jax_dora.registry import Registry

# Result statuses. A result has exactly one; ``truncated`` is a separate flag
# because a long output can come with any of them.
OK = "ok"                        # ran to the end, exit code 0
ERROR = "error"                  # the code failed (exception, non-zero exit, syntax error)
TIMEOUT = "timeout"              # wall-clock or CPU-time limit
MEMORY = "memory"                # the memory limit (MemoryError)
KILLED = "killed"                # ended by a signal other than the limits above
SANDBOX_ERROR = "sandbox_error"  # the tool could not run the call at all (not the code's fault)
STATUSES = (OK, ERROR, TIMEOUT, MEMORY, KILLED, SANDBOX_ERROR)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One call as parsed from the model's text.

  Attributes:
    tool: Registered tool name (``"python"``).
    arguments: The text the model wrote for the tool; for ``python``, the
      program.
    call_id: Caller's identifier (trajectory and turn), echoed in logs only.
  """

  tool: str
  arguments: str
  call_id: str = ""


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """What the model gets back, plus what the metrics need.

  Attributes:
    observation: Text appended to the context: the output, truncated to the
      tool's budget, and a one-line note for any limit that was hit.
    status: One of :data:`STATUSES`.
    exit_code: The program's exit code (128 + N for signal N), None if it
      never ran.
    wall_s: Seconds from the start of the call to the result.
    truncated: The output was longer than the budget (the middle was cut).
    output_bytes: Size of the whole output before truncation.
  """

  observation: str
  status: str
  exit_code: int | None = None
  wall_s: float = 0.0
  truncated: bool = False
  output_bytes: int = 0

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f"unknown tool status {self.status!r}; known: {STATUSES}")


@runtime_checkable
class Tool(Protocol):
  """A tool the orchestrator can call from many trajectories at once.

  ``run`` must not block the event loop, must return within its own limits
  (plus a small margin) and must turn every failure into a
  :class:`ToolResult`; ``close`` ends anything still running.
  """

  name: str

  async def run(self, call: ToolCall) -> ToolResult: ...

  def close(self) -> None: ...


ToolFactory = Callable[..., Tool]

TOOLS: Registry[ToolFactory] = Registry("tool")


def make_tool(name: str, **options: Any) -> Tool:
  """A new instance of the tool registered as ``name``, with its options."""
  return TOOLS.get(name)(**options)
