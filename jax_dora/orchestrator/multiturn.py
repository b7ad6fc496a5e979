"""Multi-turn rollouts: a turn ends at a tool call, the tool runs, its observation is appended.

**Token in, token out.** A trajectory is only ever extended: the ids the
engine sampled stay as they are, and the observation's ids (its fixed
wrapper text, tokenised alone) are appended after them. The conversation is
never decoded and re-tokenised, which frameworks that re-render a chat
template between turns found to drift the ids away from what was sampled
(and training then fails to converge). The decoded text of a turn is used
only to *find* the call.

A :class:`CallFormat` says how a tool's calls look in text: the stop strings
that end a turn, how to cut the call out of the turn, and how to wrap the
observation. Every stop gets an observation, so the model always sees why
generation resumed: the tool's output, its error, "[tool call limit
reached]" past ``tools.max_calls``, or "[error: ...]" for a stop that holds
no parsable call. Observations longer than ``tools.max_observation_tokens``
are cut, and say so.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Protocol

import numpy as np

from jax_dora.registry import Registry
from jax_dora.tools.base import ToolCall, ToolResult
from jax_dora.types import Trajectory, no_route


class CallFormat(Protocol):
  """How one tool's calls and observations look in the model's text."""

  stop_strings: tuple[str, ...]
  deterministic: bool  # whether re-running a call must reproduce its observation

  def parse(self, turn_text: str, prompt: Any = None) -> str | None:
    """The call's arguments in the turn that just ended at a stop string (None: no call).

    ``prompt``: the trajectory's ``Prompt`` (a format may default to its task's own input).
    """

  def wrap(self, observation: str) -> str:
    """The text appended after the call (what the model reads)."""

  def observation_spans(self, text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the wrapped observations in a written trace.

    SFT on tool-integrated traces keeps them out of the loss (``jax_dora.data.sft``).
    """


@dataclasses.dataclass(frozen=True)
class CalculatorFormat:
  """``4821*937=`` -> ``[4517277]``: the expression right before ``=``.

  A bare ``=`` (no expression before it) evaluates the prompt's own
  expression (``Prompt.meta["expression"]``, set by the ``mul`` task): a tool
  call without arguments, like an agent's "run the tests". A random policy
  writes one often enough to find out that calling pays; writing the
  operands out exactly (also accepted) is too rare to be explored by the
  tiny model, and a partly copied expression was measured to be trained
  away before it could improve (issue 25's notes).
  """

  stop_strings: tuple[str, ...] = ("=",)
  deterministic: bool = True  # a call re-run gives the same observation (the audit relies on it)
  _expression = re.compile(r"([0-9+\-*() ]*)=$")

  def parse(self, turn_text: str, prompt: Any = None) -> str | None:
    m = self._expression.search(turn_text)
    if m is None:
      return None
    if any(c.isdigit() for c in m.group(1)):
      return m.group(1).strip()
    own = getattr(prompt, "meta", {}).get("expression") if prompt is not None else None
    return str(own) if own else None

  def wrap(self, observation: str) -> str:
    return f"[{observation}]"

  def observation_spans(self, text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"\[[^\]\n]*\]", text)]


@dataclasses.dataclass(frozen=True)
class PythonBlockFormat:
  """The usual convention of tool-integrated reasoning on HF models.

  The model writes a fenced ``python`` block; the turn ends at its closing
  fence; the system appends a fenced ``output`` block.
  """

  stop_strings: tuple[str, ...] = ("```\n",)
  # Model-written code may read the clock or a random seed: a re-run may differ.
  deterministic: bool = False

  def parse(self, turn_text: str, prompt: Any = None) -> str | None:
    del prompt
    start = turn_text.rfind("```python\n")
    if start < 0:
      return None
    body = turn_text[start + len("```python\n"):]
    end = body.rfind("```")
    return body[:end] if end >= 0 else None

  def wrap(self, observation: str) -> str:
    # A program's output usually ends with print's newline: the block's own
    # line break replaces it (``12\n`` reads ``12``, not ``12`` and an empty line).
    body = observation[:-1] if observation.endswith("\n") else observation
    return f"```output\n{body}\n```\n"

  def observation_spans(self, text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"```output\n.*?\n```\n", text, re.DOTALL)]


FORMATS: Registry[CallFormat] = Registry("tool call format")
FORMATS.register("calculator", CalculatorFormat())
FORMATS.register("python", PythonBlockFormat())


class ToolLoop:
  """The tool side of a multi-turn rollout, shared by training and held-out eval.

  Args:
    tool: Registered tool name (the executor must have it).
    executor: ``call(ToolCall) -> ToolResult`` (``jax_dora.tools.ToolExecutor``).
    tokenizer: Encodes observations (alone, without BOS).
    max_calls: Calls per trajectory.
    max_observation_tokens: Observation ids appended per call at most.
    stop_strings: Override the format's stop strings (``tools.stop_strings``).
    max_turn_tokens: Tokens one turn may sample (0: the trajectory's budget only).
  """

  def __init__(self, tool: str, executor: Any, tokenizer: Any, *, max_calls: int,
               max_observation_tokens: int, stop_strings: tuple[str, ...] = (),
               max_turn_tokens: int = 0):
    self.tool = tool
    self.format = FORMATS.get(tool)
    self.executor = executor
    self.tokenizer = tokenizer
    self.max_calls = max_calls
    self.max_observation_tokens = max_observation_tokens
    self.stop_strings = tuple(stop_strings) or self.format.stop_strings
    self.max_turn_tokens = int(max_turn_tokens)

  @classmethod
  def from_config(cls, tools: Any, executor: Any, tokenizer: Any) -> ToolLoop | None:
    """From the run's ``tools`` block (``jax_dora.config.ToolsConfig``); None when off."""
    if not tools.enabled:
      return None
    return cls(tools.name, executor, tokenizer, max_calls=tools.max_calls,
               max_observation_tokens=tools.max_observation_tokens,
               stop_strings=tools.stop_list, max_turn_tokens=tools.max_turn_tokens)

  def turn_budget(self, turn_start: int, budget: int) -> int:
    """The completion length the turn starting at ``turn_start`` may reach.

    Without a per-turn cap one rambling turn can spend the whole budget, and
    a policy that calls a tool then rambles scores worse than one that never
    calls: GRPO then trains calls away before it can learn to use their
    observations (measured on the tiny calculator workload).
    """
    if self.max_turn_tokens <= 0:
      return budget
    return min(budget, turn_start + self.max_turn_tokens)

  def _encode(self, text: str) -> np.ndarray:
    """``text``'s ids as untrusted text (special-token strings stay text: ``encode_text``);
    characters a closed vocabulary lacks (the tiny model's) become ``?``."""
    try:
      return np.asarray(self.tokenizer.encode_text(text), np.int32).reshape(-1)
    except ValueError:
      def ok(c: str) -> bool:
        try:
          self.tokenizer.encode_text(c)
          return True
        except ValueError:
          return False
      safe = "".join(c if ok(c) else "?" for c in text)
      return np.asarray(self.tokenizer.encode_text(safe), np.int32).reshape(-1)

  def observation_ids(self, observation: str) -> tuple[np.ndarray, bool]:
    """The wrapped observation's ids, cut to the budget (the cut says so)."""
    ids = self._encode(self.format.wrap(observation))
    if len(ids) <= self.max_observation_tokens:
      return ids, False
    note = self._encode(self.format.wrap("[observation truncated]"))
    if len(note) >= self.max_observation_tokens:
      return ids[:self.max_observation_tokens], True
    keep = self.max_observation_tokens - len(note)
    cut = self._encode(self.format.wrap(observation[:max(0, keep)] + " [observation truncated]"))
    return cut[:self.max_observation_tokens], True

  async def respond(self, traj: Trajectory, turn_start: int, call_id: str, *, room: int,
                    version: Any = None) -> dict[str, Any]:
    """Runs the call the turn ``[turn_start:]`` of ``traj`` ended with and appends the
    observation to ``traj`` (completion, zero log-probs, a context span, a record).

    ``room``: completion tokens left in the budget (the observation is cut to
    it). ``version()``: the learner's newest version, read before and after
    the call (``version_start``/``version_end``: how many versions the call
    spanned, for PACE's tool-wait term).
    """
    v0 = version() if version is not None else 0
    text = self.tokenizer.decode(np.asarray(traj.completion_tokens[turn_start:]).tolist())
    arguments = self.format.parse(text, traj.prompt)
    if len(traj.tool_calls) >= self.max_calls:
      result = ToolResult("tool call limit reached", "error")
    elif arguments is None:
      result = ToolResult("error: no tool call found before the stop marker", "error")
    else:
      result = await self.executor.call(ToolCall(self.tool, arguments, call_id))
    ids, cut = self.observation_ids(result.observation)
    if len(ids) > room:
      ids, cut = ids[:room], True
    start = traj.num_completion_tokens
    traj.completion_tokens = np.concatenate([traj.completion_tokens, ids]).astype(np.int32)
    traj.behaviour_logprobs = np.concatenate(
        [traj.behaviour_logprobs, np.zeros((len(ids),), np.float32)])
    traj.context_spans = [*traj.context_spans, (start, start + len(ids))]
    if traj.routing is not None:  # not run yet: the next turn's prefill records them
      gap = np.full((len(ids),) + traj.routing.shape[1:], no_route(traj.routing.dtype),
                    traj.routing.dtype)
      traj.routing = np.concatenate([traj.routing, gap])
    ran = arguments is not None and len(traj.tool_calls) < self.max_calls
    # "call": what the tool ran (None when it did not run: over the limit, or
    # no parsable call); "parsed": what was cut out of the turn either way.
    record = {"turn": len(traj.tool_calls), "tool": self.tool,
              "call": arguments if ran else None, "parsed": arguments,
              "observation": result.observation, "status": result.status,
              "exit_code": result.exit_code, "wall_s": round(result.wall_s, 6),
              "truncated": bool(result.truncated or cut), "start": start,
              "end": start + len(ids), "ids": ids.tolist(), "version_start": v0,
              "version_end": version() if version is not None else 0}
    traj.tool_calls = [*traj.tool_calls, record]
    return record


  async def take_turn(self, traj: Trajectory, turn_start: int, budget: int, call_id: str,
                      version: Any = None) -> bool:
    """After a turn of ``traj`` ended at a stop string: answers the call and says
    whether the trajectory goes on (False: the length budget is spent, and
    ``finish_reason`` is ``length``). Shared by training and held-out eval."""
    room = budget - traj.num_completion_tokens
    if room > 0:
      await self.respond(traj, turn_start, call_id, room=room, version=version)
    if traj.num_completion_tokens >= budget:
      traj.finish_reason = "length"
      return False
    return True


async def recheck_tool_calls(records: list[dict[str, Any]], tools: ToolLoop, *, sample: int,
                             seed: int = 0) -> tuple[list[str], dict[str, int]]:
  """Re-runs a sample of the tool calls in trained records (the audit's tool check).

  Each re-run must give the recorded observation (for a deterministic tool;
  others count as ``irreproducible``, since model-written code may read the
  clock), and the recorded ids must be that observation's wrapped ids, as
  the learner trained them. Returns ``(violations, counts)``.
  """
  import random  # pylint: disable=g-import-not-at-top

  calls = [(r, c) for r in records for c in r.get("tool_calls", ())
           if c.get("call") is not None and c.get("tool") == tools.tool]
  picked = random.Random(seed).sample(calls, min(sample, len(calls)))
  out: list[str] = []
  counts = {"rechecked": 0, "irreproducible": 0}
  for r, c in picked:
    key = (r["sample_id"], r["member"])
    result = await tools.executor.call(ToolCall(tools.tool, c["call"], f"audit-{key}"))
    counts["rechecked"] += 1
    if result.observation != c["observation"]:
      if tools.format.deterministic:
        out.append(f"{key}: tool call {c['turn']} ({c['call']!r}) recorded observation"
                   f" {c['observation']!r}, the tool returns {result.observation!r}")
      else:
        counts["irreproducible"] += 1
      continue
    ids, _ = tools.observation_ids(c["observation"])
    if ids[:len(c["ids"])].tolist() != list(c["ids"]):
      out.append(f"{key}: tool call {c['turn']}: the trained ids are not its wrapped observation")
  return out, counts
