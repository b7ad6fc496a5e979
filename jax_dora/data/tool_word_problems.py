"""Word problems whose last step needs the ``python`` tool: tool-integrated reasoning data.

The shipped base model (``jax_dora/base_model``) computes the word problems'
small numbers in its head (totals below 2000). This module extends them with
a last step it cannot do reliably in its head: multiplying the running total
(up to four digits) by a three- or four-digit number. A solution works the
small steps as before, then writes a fenced ``python`` block that prints the
product, reads the fenced ``output`` block the tool returns, and copies that
number into its last line (``jax_dora.orchestrator.multiturn.PythonBlockFormat``)::

  {"question": "Mia has 12 apples. She buys 5 more apples. Each of the apples weighs
                2189 grams. How many grams do the apples weigh in all?",
   "answer": "12 + 5 = 17\\n```python\\nprint(17 * 2189)\\n```\\n```output\\n37213\\n```\\n"
             "17 * 2189 = 37213\\n#### 37213",
   "difficulty": 1}

* The first part is :func:`jax_dora.data.word_problems.make_problem` of
  ``difficulty`` operations (1 to 3 here), its question sentence replaced by
  the weight sentence and a new question; so the model still has to work the
  small steps right before the tool can help.
* SFT (``configs/tool_sft.py``) trains on the whole trace with the ``output``
  block masked out of the loss (the tool writes it, ``jax_dora.data.sft``);
  RL prompts and held-out answers are graded on ``#### N`` by
  ``math_verify`` as before.
* Without the tool (``--config.tools.name=``) the model's habit of writing the
  program stays, and it must write the output block itself: a guess at a
  product of up to eight digits. That is the baseline the tool must beat.
* The held-out split and determinism follow ``word_problems``' rules (crc32 of
  the question; row ``i`` a pure function of ``(seed, i)``); the RNG streams
  are ``default_rng([seed, i, 2])`` so the small-step part differs from the
  base corpus' rows of the same index.

Write the files with::

  python -m jax_dora.data.tool_word_problems --out=data/tool_word_problems
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np

from jax_dora.data import word_problems as wp

MIN_FACTOR, MAX_FACTOR = 101, 9999  # the tool step's multiplier: three or four digits
TOOL_DIFFICULTIES = (1, 2, 3)  # small in-head steps before the tool step
WEIGHT = (
    "Each of the {items} weighs {m} grams.",
    "One of the {items} weighs {m} grams.",
    "Every one of the {items} weighs {m} grams.",
)
TOOL_QUESTION = (
    "How many grams do the {items} weigh in all?",
    "What is the total weight of the {items} in grams?",
    "How many grams do all the {items} weigh together?",
)


def program(total: int, factor: int) -> str:
  """The code the trace runs: prints the product."""
  return f"print({total} * {factor})"


def trace(lines: Sequence[str], total: int, factor: int) -> str:
  """The worked solution: small steps, the python block, the tool's output, the copied answer."""
  product = total * factor
  return "\n".join([*lines, f"```python\n{program(total, factor)}\n```\n```output\n{product}\n```",
                    f"{total} * {factor} = {product}", f"#### {product}"])


def make_tool_problem(rng: np.random.Generator, difficulty: int) -> wp.WordProblem:
  """A base problem of ``difficulty`` in-head steps, then a multiply the tool computes."""
  base = wp.make_problem(rng, difficulty)
  factor = int(rng.integers(MIN_FACTOR, MAX_FACTOR + 1))
  # The base question's last sentence asks for the count (it names the items): replace it.
  sentences = base.question.rsplit("?", 1)[0]
  body, asked = sentences[:sentences.rfind(".") + 1], sentences[sentences.rfind(".") + 1:]
  items = next(it for it, _ in wp.ITEMS if f" {it}" in f" {asked}")
  question = " ".join([body, str(rng.choice(WEIGHT)).format(items=items, m=factor),
                       str(rng.choice(TOOL_QUESTION)).format(items=items)])
  lines = base.answer.splitlines()[:-1]  # the worked steps without "#### N"
  return wp.WordProblem(question, trace(lines, base.result, factor), difficulty,
                        base.result * factor)


def generate(n: int, seed: int, *, heldout: bool,
             difficulties: Sequence[int] = TOOL_DIFFICULTIES,
             heldout_fraction: float = wp.HELDOUT_FRACTION) -> Iterator[wp.WordProblem]:
  """``n`` distinct tool problems on one side of the held-out split (see the module doc)."""
  seen: set[str] = set()
  for i in range(n):
    rng = np.random.default_rng([seed, i, 2])
    d = wp.difficulty_of(i, difficulties)
    for _ in range(wp._MAX_DRAWS):  # pylint: disable=protected-access
      p = make_tool_problem(rng, d)
      if wp.is_heldout_question(p.question, heldout_fraction) == heldout and p.question not in seen:
        break
    else:
      raise RuntimeError(f"row {i}: no new tool problem of difficulty {d}")
    seen.add(p.question)
    yield p


# The files configs/tool_sft.py and configs/tiny_math_tools.py read.
SPLITS = {
    "sft_train.jsonl": dict(n=20_000, seed=10, heldout=False),
    "rl_train.jsonl": dict(n=4_000, seed=11, heldout=False),
    "test.jsonl": dict(n=600, seed=12, heldout=True),
}


def main(argv: Sequence[str] | None = None) -> None:
  import argparse  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="data/tool_word_problems", help="Directory for the files.")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="Multiply every split's row count (tests write small files).")
  args = parser.parse_args(argv)
  for name, spec in SPLITS.items():
    spec = dict(spec, n=max(1, int(spec["n"] * args.scale)))
    path = os.path.join(args.out, name)
    print(f"{path}: {wp.write_jsonl(path, generate(**spec))} problems")


if __name__ == "__main__":
  main()
