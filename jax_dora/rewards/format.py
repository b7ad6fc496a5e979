"""``format``: 1.0 when the completion ends with one clearly marked final answer.

A small shaping term for instruction-following (as in DeepSeek-R1-style
recipes): a ``\\boxed{...}`` or a GSM8K ``#### N`` line must be present, and
nothing but whitespace and punctuation may follow the marked answer, so
rambling past it does not pay.
"""

from __future__ import annotations

import re

from jax_dora.rewards.base import register
from jax_dora.rewards.extract import hash_answer, last_boxed_span
from jax_dora.types import Prompt

_TRAILING_OK = re.compile(r"[\s.$\\)\]]*")


@register("format")
def format_reward(prompt: Prompt, completion: str) -> float:
  del prompt
  span = last_boxed_span(completion)
  if span is not None:
    end = span[1]
  elif hash_answer(completion) is not None:
    end = len(completion.rstrip())
  else:
    return 0.0
  return 1.0 if _TRAILING_OK.fullmatch(completion[end:]) else 0.0
