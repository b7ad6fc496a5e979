"""``math_verify``: 1.0 iff the completion's final answer equals the ground truth.

The final answer is extracted with :func:`~jax_dora.rewards.extract.final_answer`
(``\\boxed{}``, then GSM8K's ``#### N``, then the last number) and compared
with Hugging Face's ``math-verify`` (symbolic equivalence: ``0.5`` equals
``\\frac{1}{2}``, ``1,000`` equals ``1000``). It parses arbitrary model output
with sympy, so it is ``isolated``: the scorer runs it in a worker process
with a deadline.
"""

from __future__ import annotations

from jax_dora.rewards.base import register
from jax_dora.rewards.extract import final_answer
from jax_dora.types import Prompt


def _as_latex(answer: str) -> str:
  answer = answer.strip()
  return answer if answer.startswith("$") else f"${answer}$"


@register("math_verify", isolated=True)
def math_verify_reward(prompt: Prompt, completion: str) -> float:
  from math_verify import parse, verify  # pylint: disable=g-import-not-at-top

  predicted = final_answer(completion)
  if predicted is None:
    return 0.0
  gold = parse(_as_latex(prompt.answer))
  if not gold:
    raise ValueError(f"ground truth {prompt.answer!r} of sample {prompt.sample_id} does not parse")
  return 1.0 if verify(gold, parse(_as_latex(predicted))) else 0.0
