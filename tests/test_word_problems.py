"""The word-problem generator: right answers, deterministic files, a held-out split disjoint by text.

The oracle for the answers is the question text itself: its numbers are read
back with a regex and the stated operations re-applied by hand-written rules
(which sentence means which operation), independently of the generator's
own bookkeeping.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from jax_dora.data import word_problems as wp
from jax_dora.rewards.extract import hash_answer

# Sentence -> operation, written from the phrasings' meaning, not imported.
_OPS = (
    (re.compile(r"buys|finds|friend gives|gets \d+ more"), "+"),
    (re.compile(r"gives away|sells|loses|gives \d+ \w+ to"), "-"),
    (re.compile(r"times as many|with that many|multiplied by"), "*"),
    (re.compile(r"equally into|one of every"), "/"),
)


def _solve_from_text(question: str) -> int:
  sentences = [s for s in re.split(r"(?<=[.?])\s+", question) if s]
  total = int(re.search(r"\d+", sentences[0]).group())
  for s in sentences[1:-1]:
    n = int(re.search(r"\d+", s).group())
    ops = [op for pattern, op in _OPS if pattern.search(s)]
    assert len(ops) == 1, (s, ops)
    op = ops[0]
    if op == "+":
      total += n
    elif op == "-":
      total -= n
    elif op == "*":
      total *= n
    else:
      assert total % n == 0, (question, total, n)
      total //= n
  return total


def test_every_answer_is_what_the_question_says():
  problems = list(wp.generate(600, seed=3, heldout=False))
  for p in problems:
    truth = _solve_from_text(p.question)
    assert hash_answer(p.answer) == str(truth), (p.question, p.answer)
    lines = p.answer.split("\n")
    assert len(lines) == p.difficulty + 1
    for line in lines[:-1]:  # each worked line is right arithmetic
      a, op, b, _, c = line.split()
      a, b, c = int(a), int(b), int(c)
      assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op] and (op != "/" or a % b == 0)
      assert 0 < c < wp.MAX_TOTAL
  # The mix cycles through every difficulty.
  assert sorted({p.difficulty for p in problems}) == [1, 2, 3, 4, 5, 6]


def test_the_noisy_teacher_miscopies_only_the_answer_line():
  """miscopy_rate: that share of rows ends with an operand of the last line, the work intact."""
  clean = list(wp.generate(2000, seed=5, heldout=False))
  noisy = list(wp.generate(2000, seed=5, heldout=False, miscopy_rate=0.4))
  assert [p.question for p in noisy] == [p.question for p in clean]  # same questions
  miscopied = 0
  for c, n in zip(clean, noisy):
    work_c, work_n = c.answer.split("\n")[:-1], n.answer.split("\n")[:-1]
    assert work_n == work_c  # every worked line is the clean one
    said = int(hash_answer(n.answer))
    if said != _solve_from_text(n.question):
      miscopied += 1
      a, _, b, _, _ = work_n[-1].split()  # the slip copies a number of the last line
      assert said in (int(a), int(b))
  # 40% of rows drawn for a slip (binomial std over 2000 rows: 1.1 points).
  assert 0.36 < miscopied / len(noisy) < 0.44, miscopied
  # Hand-checked row: "596 - 14 = 582" can end "#### 596" or "#### 14", never "#### 582".
  p = wp.WordProblem("q", "67 * 3 = 201\n201 - 52 = 149\n149 * 4 = 596\n596 - 14 = 582\n#### 582",
                     4, 582)
  assert wp.miscopied_answers(p) == [14, 596]
  with pytest.raises(ValueError, match="miscopy_rate"):
    next(wp.generate(1, seed=0, heldout=False, miscopy_rate=0.5))


def test_hand_worked_problem():
  """One problem solved by hand: the format a row has on disk."""
  rng = np.random.default_rng([0, 2])
  p = wp.make_problem(rng, 2)
  row = p.to_json()
  assert set(row) == {"question", "answer", "difficulty"}
  assert row["question"].endswith("?") and row["answer"].endswith(f"#### {p.result}")
  assert row["difficulty"] == 2


def test_files_are_deterministic_and_the_heldout_split_disjoint_by_text(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  wp.main([f"--out={a}", "--scale=0.02"])
  wp.main([f"--out={b}", "--scale=0.02"])
  for name in wp.SPLITS:
    assert (a / name).read_bytes() == (b / name).read_bytes()

  def questions(name):
    return [json.loads(line)["question"] for line in (a / name).read_text().splitlines()]

  test = questions("test.jsonl")
  train = questions("sft_train.jsonl") + questions("rl_train.jsonl")
  assert len(set(test)) == len(test) and not set(test) & set(train)
  assert all(wp.is_heldout_question(q) for q in test)
  assert not any(wp.is_heldout_question(q) for q in train)


def test_bad_arguments_are_refused(tmp_path):
  with pytest.raises(ValueError, match="difficulty 7"):
    wp.make_problem(np.random.default_rng(0), 7)
  with pytest.raises(SystemExit):
    wp.main([f"--out={tmp_path}", "--only=nope.jsonl"])
