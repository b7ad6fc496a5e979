"""``calculator``: integer arithmetic the policy cannot do in its head.

The tool of the tiny model's multi-turn workload (``tasks.MulTask``): the
policy writes ``4821*937=`` and gets ``[4517277]`` back. It evaluates only
integer literals, ``+ - *`` and parentheses, through Python's parser with a
whitelist of node types and bounds on size, never ``eval``: nothing the model
writes can run, so it needs no sandbox process and answers in microseconds.
"""

from __future__ import annotations

import ast
import time

from jax_dora.tools import base

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 60
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


class CalculatorError(ValueError):
  """The expression is not integer arithmetic within the bounds."""


def evaluate(expression: str) -> int:
  """The value of an integer ``+ - *`` expression; :class:`CalculatorError` otherwise."""
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError as e:
    raise CalculatorError(f"not an expression: {expression.strip()!r}") from e

  def bounded(v: int) -> int:
    if len(str(abs(v))) > MAX_RESULT_DIGITS:
      raise CalculatorError(f"a number longer than {MAX_RESULT_DIGITS} digits")
    return v

  def value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
      v = value(node.operand)
      return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return bounded(_OPS[type(node.op)](value(node.left), value(node.right)))
    raise CalculatorError(f"unsupported: {ast.dump(node)[:60]}")

  return value(tree.body)


class CalculatorTool:
  """``Tool``: ``arguments`` is the expression; the observation is its value."""

  name = "calculator"

  def __init__(self, **unused_options):
    del unused_options  # the sandbox limits of other tools do not apply

  async def run(self, call: base.ToolCall) -> base.ToolResult:
    t0 = time.perf_counter()
    try:
      out, status = str(evaluate(call.arguments)), base.OK
    except CalculatorError as e:
      out, status = f"error: {e}", base.ERROR
    return base.ToolResult(out, status, exit_code=0 if status == base.OK else 1,
                           wall_s=time.perf_counter() - t0, output_bytes=len(out))

  def close(self) -> None:
    pass


base.TOOLS.register("calculator", CalculatorTool)
