"""``mul``: multiply numbers too long for the tiny model to multiply in its head.

``"mul 4821*937:"`` -> ``"4517277"``. The multi-turn workload of the tiny
character model (issue 25). With ``tools.name=calculator`` the policy can
call the calculator (``4821*937=``, or a bare ``=``, which evaluates the
prompt's own expression) and the system appends ``[4517277]``. A completion
that ends right at an observation answers with it: the program-of-thought
convention (PAL, PoT), where the interpreter's result is the answer. A
completion that writes text after its last observation answers with that
text (copying the observation out is right too). Without the tool the policy
can only guess digits.

So the policy has to learn, by reward alone, to write the call in its first
turn and to stop right after the observation (end-of-sequence as the first
token of its second turn): credit assignment across a turn whose tokens it
did not sample. The first operand's digit count follows the long-tailed
length law, so answers (and rollouts) are long-tailed like the other tasks'.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_dora.tasks.base import Task, register, shaped_score
from jax_dora.types import Prompt


def final_answer(completion_text: str) -> str:
  """What the completion answers: the text after its last tool observation
  (``[...]``), the observation itself when nothing follows it, or the whole
  completion when it holds no observation."""
  head, bracket, tail = completion_text.rpartition("]")
  if not bracket or tail:
    return tail
  return head.rpartition("[")[2]


@register
class MulTask(Task):
  """Multiply a long-tailed ``d``-digit number by a 1-3 digit one."""

  name = "mul"

  def generate(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
    # "mul " + a + "*" + b + ":" within max_prompt_len; the product has at most d + 3 digits.
    max_digits = max(1, min(self.max_answer_len - 3, self.max_prompt_len - len("mul *999:")))
    d = self.sample_length(rng, max_digits)
    lo = 0 if d == 1 else 10 ** (d - 1)
    a = lo + int(rng.random() * (10**d - lo))
    b = int(rng.integers(2, 10 ** int(rng.integers(1, 4))))
    return f"mul {a}*{b}:", str(a * b), {"a": a, "b": b, "expression": f"{a}*{b}"}

  def score(self, prompt: Prompt, completion_text: str) -> float:
    return shaped_score(prompt.answer, final_answer(completion_text))
