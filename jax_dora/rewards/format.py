"""``format``: 1.0 when the completion ends with one clearly marked final answer.

A small shaping term for instruction-following (as in DeepSeek-R1-style
recipes): a ``\\boxed{...}`` or a GSM8K ``#### N`` line must be present, and
nothing but whitespace and punctuation may follow the marked answer, so
rambling past it does not pay.
"""

from __future__ import annotations

import re

from jax_dora.rewards.base import register
from jax_dora.rewards.extract import last_boxed_span
from jax_dora.types import Prompt

_TRAILING_OK = re.compile(r"[\s.$\\)\]]*")
_HASH_MARK = re.compile(r"####[ \t]*\S+")


@register("format")
def format_reward(prompt: Prompt, completion: str) -> float:
  del prompt
  span = last_boxed_span(completion)
  marks = list(_HASH_MARK.finditer(completion))
  if span is not None:
    end = span[1]
  elif marks:
    end = marks[-1].end()
  else:
    return 0.0
  return 1.0 if _TRAILING_OK.fullmatch(completion[end:]) else 0.0
