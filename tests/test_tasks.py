"""Tasks: verifiers, shaped reward, determinism and the long-tailed lengths."""

from __future__ import annotations

import numpy as np
import pytest

from jax_dora.tasks import (
    ALLOWED_CHARS,
    TaskMixture,
    get_task,
    long_tail,
    shaped_score,
    task_names,
)
from jax_dora.types import Prompt

ALL = ["repeat", "add", "sort", "reverse"]
N = 5000


def _prompts(make, n=N, seed=0):
  return [make(i, np.random.default_rng([seed, i])) for i in range(n)]


def test_registry_has_required_tasks_and_rejects_unknown():
  assert set(ALL) <= set(task_names())
  with pytest.raises(KeyError, match="known tasks"):
    get_task("multiply")


@pytest.mark.parametrize("name", ALL)
def test_exact_answer_scores_one_empty_zero_partial_between(name):
  task = get_task(name)
  for p in _prompts(task.make_prompt, 50):
    assert task.score(p, p.answer) == 1.0
    assert task.score(p, "") == 0.0
    wrong_last = p.answer[:-1] + ("0" if p.answer[-1] != "0" else "1")
    s = task.score(p, wrong_last)
    assert 0.0 <= s < 1.0
    if len(p.answer) > 1:
      assert 0.5 <= s < 1.0  # right length, mostly right characters, not exact


def test_shaped_score_penalises_rambling_and_stopping_short():
  assert shaped_score("1234", "1234") == 1.0
  # length 0.5, charset 1, accuracy 2/4, not exact
  assert shaped_score("1234", "12") == pytest.approx(0.5)
  # length 0.5, charset 0.5, accuracy 4/8: rambling costs on three terms
  assert shaped_score("1234", "1234xxxx") == pytest.approx(0.375)
  # right length only
  assert shaped_score("1234", "9999") == pytest.approx(0.25)
  assert shaped_score("1234", "4321") == pytest.approx(0.5)
  rng = np.random.default_rng(0)
  for _ in range(200):
    a = "".join(rng.choice(list("ab"), size=rng.integers(1, 6)))
    c = "".join(rng.choice(list("ab"), size=rng.integers(0, 6)))
    assert 0.0 <= shaped_score(a, c) <= 1.0


def test_answers_are_correct_for_their_prompts():
  rep = get_task("repeat").make_prompt(0, np.random.default_rng(3))
  count, unit = rep.meta["count"], rep.meta["unit"]
  assert rep.text == f"rep {count} {unit}:" and rep.answer == unit * count
  for p in _prompts(get_task("add").make_prompt, 200):
    a, b = p.text[:-1].split("+")
    assert p.text.endswith("=") and int(p.answer) == int(a) + int(b)
  for p in _prompts(get_task("sort").make_prompt, 200):
    assert p.answer == "".join(sorted(p.text[len("sort "):-1]))
  for p in _prompts(get_task("reverse").make_prompt, 200):
    assert p.answer == p.text[len("rev "):-1][::-1]


@pytest.mark.parametrize("name", ALL)
def test_generation_is_deterministic_in_the_rng(name):
  task = get_task(name)
  a = _prompts(task.make_prompt, 100, seed=7)
  b = _prompts(task.make_prompt, 100, seed=7)
  c = _prompts(task.make_prompt, 100, seed=8)
  assert a == b
  assert [p.text for p in a] != [p.text for p in c]


def test_all_characters_allowed_and_lengths_within_limits():
  mix = TaskMixture(ALL, max_answer_len=48, max_prompt_len=30)
  for p in _prompts(mix.make_prompt):
    assert set(p.text) <= ALLOWED_CHARS and set(p.answer) <= ALLOWED_CHARS
    assert len(p.text) <= 30 and 1 <= len(p.answer) <= 48


def test_repeat_answer_lengths_are_long_tailed():
  stats = long_tail.empirical_length_stats(get_task("repeat", max_answer_len=48).make_prompt, N)
  assert stats["frac_le_8"] >= 0.75
  assert stats["p90"] <= 48 / 3
  assert stats["max"] == 48
  # The measured law matches the analytic one the benchmarks report.
  ref = long_tail.length_stats(48)
  assert abs(stats["frac_le_8"] - ref["frac_le_8"]) < 0.03
  assert abs(stats["mean"] - ref["mean"]) < 0.5


def test_default_mixture_is_long_tailed_too():
  mix = TaskMixture(ALL, [0.4, 0.2, 0.2, 0.2])
  stats = long_tail.empirical_length_stats(mix.make_prompt, N)
  assert stats["p90"] <= 16 and stats["max"] == 48


def test_long_tail_pmf_and_big_max_answer_len():
  pmf = long_tail.length_pmf(48)
  assert pmf.sum() == pytest.approx(1.0) and np.all(np.diff(pmf) < 0)
  task = get_task("repeat", max_answer_len=512, max_prompt_len=30)
  lens = [len(p.answer) for p in _prompts(task.make_prompt, 2000)]
  assert max(lens) > 48 and max(lens) <= 512 and np.median(lens) <= 4


def test_mixture_follows_weights_and_scores_any_member():
  mix = TaskMixture(["repeat", "add"], [3.0, 1.0])
  tasks = [p.task for p in _prompts(mix.make_prompt, 2000)]
  assert abs(tasks.count("repeat") / 2000 - 0.75) < 0.04
  other = Prompt(sample_id=0, task="sort", text="sort 21:", answer="12")
  assert mix.score(other, "12") == 1.0
  with pytest.raises(ValueError):
    TaskMixture(["repeat"], [1.0, 2.0])
  with pytest.raises(ValueError):
    TaskMixture(["repeat", "add"], [0.0, 0.0])


def test_padded_repeat_puts_a_long_passage_before_the_repeat_instruction():
  """The long-context workload's task: prompt fills half to all of max_prompt_len,
  the answer is the repeat instruction's (hand-checked), lengths long-tailed to
  thousands of tokens."""
  task = get_task("padded_repeat", max_answer_len=2047, max_prompt_len=300, alpha=1.1)
  prompts = _prompts(task.make_prompt, 400)
  for p in prompts:
    passage, instruction = p.text.rsplit(" rep ", 1)
    count, unit = instruction[:-1].split(" ")
    assert p.answer == unit * int(count) and len(unit) in (1, 2, 3)
    assert len(passage) == p.meta["passage_len"] and 300 // 2 - 12 <= len(p.text) <= 300
    assert set(p.text) <= ALLOWED_CHARS
    assert task.score(p, p.answer) == 1.0
  lengths = np.asarray([len(p.answer) for p in prompts])
  assert np.median(lengths) < 64 and lengths.max() > 500
  with pytest.raises(ValueError, match="no room"):
    get_task("padded_repeat", max_answer_len=2047, max_prompt_len=8).make_prompt(
        0, np.random.default_rng(0))


def test_mul_answers_with_the_text_after_the_last_observation_or_the_observation():
  """Program-of-thought scoring: ending right at the calculator's observation answers with
  it; text after it is the answer instead. Scores computed by hand from the four terms."""
  task = get_task("mul")
  p = Prompt(0, "mul", "mul 12*34:", "408")
  assert task.score(p, "408") == 1.0  # answered in its head
  assert task.score(p, "12*34=[408]") == 1.0  # answered by the call
  assert task.score(p, "x12*34=[408]408") == 1.0  # copied the observation out
  # A partly copied call: "12*3" -> 36: length 2/3, no digit of 36 in 408, no aligned hit.
  assert task.score(p, "12*3=[36]") == pytest.approx(0.25 * 2 / 3)
  # Text after the observation is the answer, even a worse one: "7" -> length 1/3 only.
  assert task.score(p, "12*34=[408]7") == pytest.approx(0.25 / 3)
  assert task.score(p, "=[error: no tool call found before the stop marker]") < 0.25
  for q in _prompts(task.make_prompt, 200):
    a, b = q.text[len("mul "):-1].split("*")
    assert int(q.answer) == int(a) * int(b) and task.score(q, f"{a}*{b}=[{q.answer}]") == 1.0
