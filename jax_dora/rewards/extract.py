"""Final-answer extraction from model output and dataset answer fields.

Pure string functions, shared by the dataset formats (the ground truth of a
GSM8K row is what follows ``####``, of a MATH row the last ``\\boxed{}``) and
the math reward (what the policy answered). Equivalence of two answers is
``math_verify``'s job (``jax_dora.rewards.math``), not this module's.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_GSM8K = re.compile(r"####[ \t]*(\S+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed_span(text: str) -> tuple[int, int] | None:
  """``(content_start, close_brace_end)`` of the last closed ``\\boxed{...}``; None if none."""
  found = None
  for m in _BOXED.finditer(text):
    depth, i = 1, m.end()
    while i < len(text) and depth:
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      i += 1
    if depth == 0:
      found = (m.end(), i)
  return found


def last_boxed(text: str) -> str | None:
  """Content of the last ``\\boxed{...}`` (or ``\\fbox``), braces balanced; None if none closes."""
  span = last_boxed_span(text)
  return None if span is None else text[span[0]:span[1] - 1].strip()


def hash_answer(text: str) -> str | None:
  """GSM8K's ``#### N`` final answer (the last marker's first word), with a leading
  ``$``, a trailing period and thousands separators dropped."""
  hits = _GSM8K.findall(text)
  if not hits:
    return None
  ans = hits[-1].lstrip("$").rstrip(".").replace(",", "")
  return ans or None


def last_number(text: str) -> str | None:
  """The last number in ``text`` (thousands separators dropped); None if there is none."""
  hits = _NUMBER.findall(text)
  if not hits:
    return None
  return hits[-1].replace(",", "")


def final_answer(text: str) -> str | None:
  """What a completion answered: ``\\boxed{}``, else ``#### N``, else the last number."""
  for extract in (last_boxed, hash_answer, last_number):
    ans = extract(text)
    if ans:
      return ans
  return None
