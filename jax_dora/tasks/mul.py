"""``mul``: multiply numbers too long for the tiny model to multiply in its head.

``"mul 4821*937:"`` -> ``"4517277"``. The multi-turn workload of the tiny
character model (issue 25): with ``tools.name=calculator`` the policy can
write ``4821*937=`` (or a bare ``=``, which computes the prompt's own
expression), read ``[4517277]`` and copy it, which a 2-layer model can
learn; without the tool it can only guess digits. The first operand's
digit count follows the long-tailed length law, so answers (and rollouts)
are long-tailed like the other tasks'.

The score is the shaped score of the *final answer*: the text after the last
tool observation (``]``), or the whole completion when no tool was called.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_dora.tasks.base import Task, register, shaped_score
from jax_dora.types import Prompt


def final_answer(completion_text: str) -> str:
  """What the policy answered after its last tool observation."""
  return completion_text.rsplit("]", 1)[-1]


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
