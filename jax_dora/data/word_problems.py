"""Arithmetic word problems in GSM8K's format: the corpus of the project's own base model.

Nothing can be downloaded where jax-dora is built and tested, so the small
pretrained policy that RL starts from (``jax_dora/base_model``, issue 36) is made the way
users make one: supervised fine-tuning on worked solutions. This module writes
those solutions. A row is GSM8K-shaped, so the RL side reads it with the
existing ``gsm8k`` format and the ``math_verify`` reward::

  {"question": "Mia has 12 apples. She buys 5 more apples. ... How many apples does Mia have now?",
   "answer": "12 + 5 = 17\\n17 * 3 = 51\\n#### 51", "difficulty": 2}

* A problem is a start quantity and ``difficulty`` operations on it (1 to 6):
  add, subtract, multiply, exact integer divide. Operand ranges grow with the
  difficulty, and the running total stays a positive integer below
  ``MAX_TOTAL``, so every step is one line ``a op b = c`` of the answer and the
  answer after ``####`` is the last line's result.
* Phrasings vary: names, items, several verbs and sentence shapes per
  operation, so a model must read the question, not match a template.
* The held-out split is disjoint *by question text* from every training file
  ever generated, whatever the seeds and sizes: a question is held out iff the
  crc32 of its text falls in the lowest ``heldout_fraction`` of the hash
  range (the data pipeline's own rule, ``jax_dora.data.pipeline``); training
  rows are drawn outside it and held-out rows inside it. Within a file,
  duplicate questions are dropped.
* A noisy teacher (``miscopy_rate``, 40% in the SFT corpus): some answers end
  with a number copied from the wrong place (an operand of the last line)
  while the worked lines stay right. The base model learns the habit some of
  the time, greedy decoding mostly not (the right answer stays the most
  common continuation): a flaw that is measurable and that RL should remove,
  like the careless-answer noise of real corpora. The RL prompts and the
  held-out answers are clean.
* Deterministic: row ``i`` of a split is a pure function of ``(seed, i)``
  (``np.random.default_rng([seed, i])``), so a file regenerates bit for bit.

Write the files with::

  python -m jax_dora.data.word_problems --out=data/word_problems
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Iterator, Sequence

import numpy as np

MIN_DIFFICULTY, MAX_DIFFICULTY = 1, 6
# Running totals stay below this, so the base model's numbers are at most
# four digits (it computes every line in its head).
MAX_TOTAL = 2000
HELDOUT_FRACTION = 0.2
_HASH_RANGE = 2**32
_MAX_DRAWS = 1000

NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Iris", "Theo", "Nora",
         "Kai", "Elsa", "Hugo", "Maya", "Ben", "Sara", "Jonas", "Aiko", "Leo")
# (plural, container) pairs: the container names a "pack" of the item.
ITEMS = (("apples", "baskets"), ("marbles", "bags"), ("stickers", "sheets"), ("books", "shelves"),
         ("coins", "jars"), ("cards", "decks"), ("pencils", "boxes"), ("cookies", "trays"),
         ("stamps", "albums"), ("shells", "buckets"), ("eggs", "cartons"), ("beads", "strings"))

# Each phrasing takes {name}, {n}, {items}, {pronoun} and, for multiply, {container}.
START = (
    "{name} has {n} {items}.",
    "{name} starts with {n} {items}.",
    "There are {n} {items} in {name}'s room.",
    "{name} owns {n} {items}.",
)
ADD = (
    "{pronoun} buys {n} more {items}.",
    "{pronoun} finds {n} more {items}.",
    "A friend gives {name} {n} {items}.",
    "{pronoun} gets {n} more {items} as a gift.",
)
SUBTRACT = (
    "{pronoun} gives away {n} {items}.",
    "{pronoun} sells {n} of the {items}.",
    "{pronoun} loses {n} {items}.",
    "{name} gives {n} {items} to a neighbour.",
)
MULTIPLY = (
    "Then {name} has {n} times as many {items} as before.",
    "{pronoun} makes {n} {container} with that many {items} in each, and keeps only those.",
    "The number of {items} is multiplied by {n}.",
)
DIVIDE = (
    "{pronoun} splits the {items} equally into {n} groups and keeps one group.",
    "{pronoun} packs the {items} equally into {n} {container} and keeps one of them.",
    "{name} keeps one of every {n} {items} and gives the rest away.",
)
QUESTION = (
    "How many {items} does {name} have now?",
    "How many {items} are there now?",
    "How many {items} does {name} have at the end?",
)
OPERATIONS = ("+", "-", "*", "/")


@dataclasses.dataclass(frozen=True)
class WordProblem:
  """One row: the question, the worked answer ending ``#### N``, and its difficulty."""

  question: str
  answer: str
  difficulty: int
  result: int

  def to_json(self) -> dict[str, object]:
    return {"question": self.question, "answer": self.answer, "difficulty": self.difficulty}


def is_heldout_question(question: str, heldout_fraction: float = HELDOUT_FRACTION) -> bool:
  """Whether ``question`` belongs to the held-out split (its crc32 in the lowest fraction)."""
  return zlib.crc32(question.encode()) < heldout_fraction * _HASH_RANGE


def _operand(rng: np.random.Generator, op: str, total: int, difficulty: int) -> int | None:
  """An operand for ``total op n`` at ``difficulty``, or None when ``op`` cannot apply."""
  if op == "+":
    n = int(rng.integers(1, 6 + 12 * difficulty))
    return n if total + n < MAX_TOTAL else None
  if op == "-":
    if total < 2:
      return None
    return int(rng.integers(1, min(total, 6 + 12 * difficulty)))
  if op == "*":
    n = int(rng.integers(2, 4 + difficulty // 2))
    return n if total * n < MAX_TOTAL else None
  divisors = [d for d in range(2, 10) if total % d == 0 and total // d >= 1]
  return int(rng.choice(divisors)) if divisors else None


def make_problem(rng: np.random.Generator, difficulty: int) -> WordProblem:
  """A problem of ``difficulty`` operations drawn from ``rng``."""
  if not MIN_DIFFICULTY <= difficulty <= MAX_DIFFICULTY:
    raise ValueError(f"difficulty {difficulty} is not in [{MIN_DIFFICULTY}, {MAX_DIFFICULTY}]")
  name = str(rng.choice(NAMES))
  items, container = ITEMS[int(rng.integers(len(ITEMS)))]
  pronoun = "She" if NAMES.index(name) % 2 == 0 else "He"
  total = int(rng.integers(2, 11 + 15 * difficulty))
  words = dict(name=name, items=items, container=container, pronoun=pronoun)
  sentences = [str(rng.choice(START)).format(n=total, **words)]
  lines = []
  phrasings = {"+": ADD, "-": SUBTRACT, "*": MULTIPLY, "/": DIVIDE}
  for _ in range(difficulty):
    for _ in range(_MAX_DRAWS):
      op = OPERATIONS[int(rng.integers(len(OPERATIONS)))]
      n = _operand(rng, op, total, difficulty)
      if n is not None:
        break
    else:  # pragma: no cover - "+ 1" always applies below MAX_TOTAL - 1, "-" above 1
      raise RuntimeError(f"no operation applies to {total}")
    new = {"+": total + n, "-": total - n, "*": total * n, "/": total // n}[op]
    sentences.append(str(rng.choice(phrasings[op])).format(n=n, **words))
    lines.append(f"{total} {op} {n} = {new}")
    total = new
  sentences.append(str(rng.choice(QUESTION)).format(**words))
  answer = "\n".join(lines + [f"#### {total}"])
  return WordProblem(" ".join(sentences), answer, difficulty, total)


def miscopied_answers(problem: WordProblem) -> list[int]:
  """The wrong numbers a careless teacher writes after ``####``: the last line's operands.

  Each is a number the worked solution wrote down (so the slip looks like
  copying from the wrong place), never the result itself.
  """
  last = problem.answer.splitlines()[-2]  # "a op b = c"
  a, _, b, _, _ = last.split()
  return sorted({int(a), int(b)} - {problem.result})


def with_miscopied_answer(problem: WordProblem, rng: np.random.Generator) -> WordProblem:
  """``problem`` whose ``#### N`` line names one of :func:`miscopied_answers` instead.

  The worked lines stay right: only the final answer is copied wrongly.
  """
  choices = miscopied_answers(problem)
  if not choices:
    return problem
  wrong = int(choices[int(rng.integers(len(choices)))])
  lines = problem.answer.splitlines()[:-1] + [f"#### {wrong}"]
  return dataclasses.replace(problem, answer="\n".join(lines))


def difficulty_of(index: int, difficulties: Sequence[int]) -> int:
  """Row ``index``'s difficulty: the mix cycles, so every prefix of a file is balanced."""
  return int(difficulties[index % len(difficulties)])


def generate(n: int, seed: int, *, heldout: bool, difficulties: Sequence[int] = tuple(
    range(MIN_DIFFICULTY, MAX_DIFFICULTY + 1)), heldout_fraction: float = HELDOUT_FRACTION,
             miscopy_rate: float = 0.0) -> Iterator[WordProblem]:
  """``n`` distinct problems on one side of the held-out split.

  Row ``i`` draws from ``default_rng([seed, i])`` until it lands on the
  requested side of the split with a question not yet in this file. With
  ``miscopy_rate`` > 0 that fraction of rows (drawn from a second stream,
  ``default_rng([seed, i, 1])``, so the questions are those of the clean file)
  ends with a miscopied ``#### N`` (:func:`with_miscopied_answer`): a noisy
  teacher, whose habit the SFT model picks up some of the time.
  """
  if not 0.0 <= miscopy_rate < 0.5:
    raise ValueError(f"miscopy_rate must be in [0, 0.5) so the right answer stays the most"
                     f" common one; got {miscopy_rate}")
  seen: set[str] = set()
  for i in range(n):
    rng = np.random.default_rng([seed, i])
    d = difficulty_of(i, difficulties)
    for _ in range(_MAX_DRAWS):
      p = make_problem(rng, d)
      if is_heldout_question(p.question, heldout_fraction) == heldout and p.question not in seen:
        break
    else:
      raise RuntimeError(f"row {i}: no new {'held-out' if heldout else 'training'} problem of"
                         f" difficulty {d} in {_MAX_DRAWS} draws")
    seen.add(p.question)
    noise = np.random.default_rng([seed, i, 1])
    yield with_miscopied_answer(p, noise) if noise.random() < miscopy_rate else p


def write_jsonl(path: str, problems: Iterator[WordProblem]) -> int:
  """Writes ``problems`` as JSONL (atomically: a temp file renamed into place); returns rows."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  n = 0
  with open(tmp, "w") as f:
    for p in problems:
      f.write(json.dumps(p.to_json()) + "\n")
      n += 1
  os.replace(tmp, path)
  return n


# The files the shipped base model and configs/tiny_math.py use (seeds fixed
# here so `python -m jax_dora.data.word_problems` reproduces them).
SPLITS = {
    # SFT corpus of the base model (not committed: regenerate it with the command). A noisy
    # teacher: 40% of its answers end with a miscopied number (the worked lines stay right),
    # a habit the base model learns some of the time and RL should remove (README, "A policy
    # with a prior").
    "sft_train.jsonl": dict(n=60_000, seed=0, heldout=False, miscopy_rate=0.4),
    # RL prompts: other questions than SFT's (another seed), still outside the held-out hashes.
    "rl_train.jsonl": dict(n=4_000, seed=1, heldout=False),
    # Held-out evaluation: disjoint by text from every training file.
    "test.jsonl": dict(n=600, seed=2, heldout=True),
}


def main(argv: Sequence[str] | None = None) -> None:
  import argparse  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="data/word_problems", help="Directory for the files.")
  parser.add_argument("--only", default="", help="Comma-separated file names (default: all).")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="Multiply every split's row count (tests write small files).")
  args = parser.parse_args(argv)
  names = [s for s in args.only.split(",") if s] or list(SPLITS)
  for name in names:
    if name not in SPLITS:
      parser.error(f"unknown file {name!r}; one of {sorted(SPLITS)}")
    spec = dict(SPLITS[name])
    spec["n"] = max(1, int(spec["n"] * args.scale))
    path = os.path.join(args.out, name)
    rows = write_jsonl(path, generate(**spec))
    print(f"{path}: {rows} problems")


if __name__ == "__main__":
  main()
