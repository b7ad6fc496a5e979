"""Task protocol, shaped reward, registry and mixtures.

A task turns ``(sample_id, rng)`` into a :class:`~jax_dora.types.Prompt` and
scores a decoded completion against it. Generation is a pure function of the
rng the data pipeline passes in (seeded from ``(seed, example_index)``), so a
resumed run and every host regenerate identical prompts without storing them.

Reward shaping
--------------
GRPO learns only from reward *differences* inside a group. A tiny model from
random init almost never produces an exact answer, so a 0/1 reward would give
all-zero groups (zero advantage, no gradient) for a long time; even aligned
character accuracy is ~1/56 for a uniform policy. Every task therefore scores
a curriculum of four equally weighted terms, from easiest to hardest:

    score = 0.25 * length_match + 0.25 * charset_precision
          + 0.25 * char_accuracy + 0.25 * exact_match

* ``length_match`` = 1 - |len(c) - len(a)| / max(len(c), len(a)): learn to
  emit EOS at the right time (also what makes output lengths long-tailed);
* ``charset_precision``: share of completion characters that occur in the
  answer (learn *which* symbols to write: digits for ``add``/``sort``);
* ``char_accuracy``: positions ``i`` with ``completion[i] == answer[i]`` over
  ``max(len(answer), len(completion))`` (penalises rambling and stopping short);
* ``exact_match``.

The score is exactly 1.0 only for the exact answer and 0.0 for an empty
completion. Measured on the tiny config: the first two terms give a uniform
random policy a clear group-relative signal from the first step.
The completion is compared verbatim (no stripping): the verifier is exact and
the tokenizer's ``decode`` already stops at EOS.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import numpy as np

from jax_dora.registry import Registry
from jax_dora.tasks import long_tail
from jax_dora.types import Prompt

# Every character a prompt or answer may contain; must stay a subset of the
# tokenizer's character set (digits, lowercase, these symbols).
DIGITS = "0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
SYMBOLS = " +-*=,:;()[]<>?!."
ALLOWED_CHARS = frozenset(DIGITS + LETTERS + SYMBOLS)

DEFAULT_MAX_ANSWER_LEN = 48
# rollout.max_prefill_length (32) minus the BOS token, minus one spare.
DEFAULT_MAX_PROMPT_LEN = 30


def char_accuracy(answer: str, completion: str) -> float:
  """Share of aligned positions that match, over the longer string's length."""
  denom = max(len(answer), len(completion))
  if denom == 0:
    return 1.0
  hits = sum(a == c for a, c in zip(answer, completion))
  return hits / denom


def length_match(answer: str, completion: str) -> float:
  longest = max(len(answer), len(completion))
  return 1.0 if longest == 0 else 1.0 - abs(len(answer) - len(completion)) / longest


def charset_precision(answer: str, completion: str) -> float:
  if not completion:
    return 0.0
  allowed = set(answer)
  return sum(c in allowed for c in completion) / len(completion)


def shaped_score(answer: str, completion: str) -> float:
  """Four-term curriculum reward in ``[0, 1]`` (see module doc)."""
  if not completion:
    return 0.0
  return 0.25 * (
      length_match(answer, completion)
      + charset_precision(answer, completion)
      + char_accuracy(answer, completion)
      + float(completion == answer)
  )


class Task(abc.ABC):
  """A synthetic task with a programmatic verifier.

  Subclasses set ``name`` and implement :meth:`generate`; the base class wraps
  the result into a :class:`Prompt` and checks the character set and length
  limits, so a new task cannot silently emit untokenisable text or prompts
  that overflow the rollout prefill buffer.

  Attributes:
    name: registry key, stored in ``Prompt.task``.
    max_answer_len: answers never exceed this many characters.
    max_prompt_len: prompt texts never exceed this many characters.
    alpha: exponent of the answer-length power law (see ``long_tail``).
  """

  name: str = ""

  def __init__(
      self,
      max_answer_len: int = DEFAULT_MAX_ANSWER_LEN,
      max_prompt_len: int = DEFAULT_MAX_PROMPT_LEN,
      alpha: float = long_tail.DEFAULT_ALPHA,
  ):
    if max_answer_len < 1:
      raise ValueError(f"max_answer_len must be >= 1, got {max_answer_len}")
    self.max_answer_len = int(max_answer_len)
    self.max_prompt_len = int(max_prompt_len)
    self.alpha = float(alpha)

  def __repr__(self) -> str:
    return (
        f"{type(self).__name__}(max_answer_len={self.max_answer_len},"
        f" max_prompt_len={self.max_prompt_len}, alpha={self.alpha})"
    )

  def sample_length(self, rng: np.random.Generator, cap: int) -> int:
    """Long-tailed target length in ``[1, min(cap, max_answer_len)]``."""
    cap = min(int(cap), self.max_answer_len)
    if cap < 1:
      raise ValueError(
          f"task {self.name!r}: max_prompt_len={self.max_prompt_len} leaves no"
          " room for an answer"
      )
    return long_tail.sample_length(rng, cap, self.alpha)

  @abc.abstractmethod
  def generate(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
    """Returns ``(text, answer, meta)`` using only ``rng`` for randomness."""

  def make_prompt(self, sample_id: int, rng: np.random.Generator) -> Prompt:
    """Builds one validated prompt; deterministic given ``rng``'s state."""
    text, answer, meta = self.generate(rng)
    if len(text) > self.max_prompt_len:
      raise AssertionError(f"{self.name}: prompt {text!r} longer than {self.max_prompt_len}")
    if not 1 <= len(answer) <= self.max_answer_len:
      raise AssertionError(f"{self.name}: answer {answer!r} outside [1, {self.max_answer_len}]")
    bad = set(text + answer) - ALLOWED_CHARS
    if bad:
      raise AssertionError(f"{self.name}: characters {sorted(bad)} not in the tokenizer set")
    return Prompt(sample_id=int(sample_id), task=self.name, text=text, answer=answer, meta=meta)

  def score(self, prompt: Prompt, completion_text: str) -> float:
    """Shaped reward in ``[0, 1]``; 1.0 iff ``completion_text`` is the answer."""
    return shaped_score(prompt.answer, completion_text)


TASKS: Registry[type[Task]] = Registry("task")
_DEFAULT_INSTANCES: dict[str, Task] = {}


def register(cls: type[Task]) -> type[Task]:
  """Class decorator adding a task to the registry under ``cls.name``."""
  if not cls.name:
    raise ValueError(f"{cls.__name__} has no name")
  return TASKS.register(cls.name, cls)


def task_names() -> list[str]:
  return TASKS.names()


def get_task(name: str, **kwargs: Any) -> Task:
  """Returns task ``name``; without kwargs a shared default instance.

  Scoring depends only on the prompt, so the runtime's reward function can use
  the shared default instance whatever limits generated the prompt.

  Args:
    name: a registered task name (see :func:`task_names`).
    **kwargs: constructor overrides (``max_answer_len``, ``max_prompt_len``,
      ``alpha``); passing any returns a fresh instance.

  Raises:
    KeyError: unknown task, with the list of known ones.
  """
  cls = TASKS.get(name)
  if kwargs:
    return cls(**kwargs)
  if name not in _DEFAULT_INSTANCES:
    _DEFAULT_INSTANCES[name] = cls()
  return _DEFAULT_INSTANCES[name]


class TaskMixture:
  """Draws each prompt from one of several tasks with fixed probabilities.

  The task is chosen with the same rng that then generates the prompt, so a
  prompt stays a pure function of its seed. ``score`` dispatches on
  ``prompt.task``, so a mixture can score prompts from any of its members.
  """

  def __init__(
      self,
      names: Sequence[str],
      weights: Sequence[float] | None = None,
      **task_kwargs: Any,
  ):
    names = list(names)
    if not names:
      raise ValueError("TaskMixture needs at least one task")
    if len(set(names)) != len(names):
      raise ValueError(f"duplicate task names in {names}")
    w = np.ones(len(names)) if weights is None else np.asarray(list(weights), np.float64)
    if w.shape != (len(names),):
      raise ValueError(f"{len(names)} tasks but {w.size} weights")
    if np.any(w < 0) or w.sum() <= 0:
      raise ValueError(f"task weights must be >= 0 with a positive sum, got {list(w)}")
    self.names = names
    self.weights = w / w.sum()
    self.tasks = [get_task(n, **task_kwargs) for n in names]
    self._by_name = dict(zip(names, self.tasks))
    self.name = "+".join(names)

  def __repr__(self) -> str:
    parts = ", ".join(f"{n}={p:.3g}" for n, p in zip(self.names, self.weights))
    return f"TaskMixture({parts})"

  def make_prompt(self, sample_id: int, rng: np.random.Generator) -> Prompt:
    i = int(rng.choice(len(self.tasks), p=self.weights))
    return self.tasks[i].make_prompt(sample_id, rng)

  def score(self, prompt: Prompt, completion_text: str) -> float:
    task = self._by_name.get(prompt.task) or get_task(prompt.task)
    return task.score(prompt, completion_text)
