"""Tools a policy can call during a multi-turn rollout (issue 25), by name.

Usage::

  with ToolExecutor(["python"], max_concurrency=16,
                    options={"python": {"limits": Limits(wall_s=5),
                                        "protected": (run_dir,)}}) as tools:
    result = await tools.call(ToolCall("python", code))
    result.observation, result.status      # "ok" | "error" | "timeout" | "memory" | ...
    tools.metrics()                        # {"tools/calls": ..., "tools/timeouts": ..., ...}

Built-in tools: ``python`` (contained execution, ``python_exec``). A new tool
is one module with a :class:`Tool` class registered in ``TOOLS`` plus its
import line in ``builtin``.
"""

from jax_dora.tools import builtin  # noqa: F401  (fills the registry)
from jax_dora.tools.base import TOOLS, Tool, ToolCall, ToolResult, make_tool
from jax_dora.tools.executor import ToolExecutor
from jax_dora.tools.python_exec import PythonTool
from jax_dora.tools.sandbox import Limits

__all__ = ["TOOLS", "Limits", "PythonTool", "Tool", "ToolCall", "ToolExecutor", "ToolResult",
           "make_tool"]
