"""The built-in tasks: ``repeat``, ``add``, ``sort``, ``reverse``.

Each draws a long-tailed target length (``long_tail``) and builds a prompt
around it. Only ``repeat`` can reach ``max_answer_len`` because its prompt
size does not grow with the answer ("rep 48 a:"); the others copy their input
into the prompt, so their answers are capped by ``max_prompt_len`` and give
the short, dense part of the mixture.

Formats (prompt -> answer):

* ``repeat``:  ``"rep 3 ab:"``     -> ``"ababab"``   (unit of 1-3 letters)
* ``add``:     ``"12+7="``         -> ``"19"``       (non-negative integers)
* ``sort``:    ``"sort 3142:"``    -> ``"1234"``     (digits, ascending)
* ``reverse``: ``"rev abc:"``      -> ``"cba"``      (letters)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_dora.tasks.base import DIGITS, LETTERS, Task, register


def _random_string(rng: np.random.Generator, alphabet: str, n: int) -> str:
  idx = rng.integers(0, len(alphabet), size=n)
  return "".join(alphabet[i] for i in idx)


@register
class RepeatTask(Task):
  """Repeat a short unit ``count`` times; the long tail of the mixture.

  The answer length ``L`` is drawn first and the unit length is a divisor of
  ``L`` in ``{1, 2, 3}``, so the answer-length law is exactly the power law.
  """

  name = "repeat"

  def generate(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
    length = self.sample_length(rng, self.max_answer_len)
    unit_lens = [k for k in (1, 2, 3) if length % k == 0]
    k = unit_lens[int(rng.integers(0, len(unit_lens)))]
    unit = _random_string(rng, LETTERS, k)
    count = length // k
    return f"rep {count} {unit}:", unit * count, {"count": count, "unit": unit}


@register
class AddTask(Task):
  """Add two non-negative integers; the larger has a long-tailed digit count."""

  name = "add"

  def generate(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
    # "a+b=" with both operands <= d digits; the sum has <= d + 1 digits.
    max_digits = min(self.max_answer_len - 1, (self.max_prompt_len - 2) // 2)
    d = self.sample_length(rng, max_digits)
    d_other = int(rng.integers(1, d + 1))

    def operand(digits: int) -> int:
      lo = 0 if digits == 1 else 10 ** (digits - 1)
      # Python ints: rng.integers overflows past int64 for long operands.
      return lo + int(rng.random() * (10**digits - lo))

    a, b = operand(d), operand(d_other)
    if rng.random() < 0.5:
      a, b = b, a
    return f"{a}+{b}=", str(a + b), {"a": a, "b": b}


@register
class SortTask(Task):
  """Sort a string of digits ascending."""

  name = "sort"

  def generate(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
    n = self.sample_length(rng, self.max_prompt_len - len("sort :"))
    digits = _random_string(rng, DIGITS, n)
    return f"sort {digits}:", "".join(sorted(digits)), {"length": n}


@register
class ReverseTask(Task):
  """Reverse a string of letters."""

  name = "reverse"

  def generate(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
    n = self.sample_length(rng, self.max_prompt_len - len("rev :"))
    s = _random_string(rng, LETTERS, n)
    return f"rev {s}:", s[::-1], {"length": n}
