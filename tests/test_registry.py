"""The one registry type behind losses, rewards, data formats, model families and tasks."""

from __future__ import annotations

import dataclasses
import re

import pytest

from jax_dora.registry import DuplicateNameError, Registry, UnknownNameError


def _double(x: int) -> int:
  return 2 * x


def _triple(x: int) -> int:
  return 3 * x


def test_register_get_and_the_container_protocol():
  reg: Registry = Registry("widget")
  assert reg.register("double", _double) is _double
  assert reg.register("triple", _triple) is _triple
  assert reg.get("double") is _double and reg.get("double")(4) == 8
  assert "triple" in reg and "quadruple" not in reg
  assert len(reg) == 2
  assert reg.names() == ["double", "triple"]
  assert list(reg) == ["double", "triple"]
  assert reg.items() == [("double", _double), ("triple", _triple)]


def test_decorator_form_registers_and_returns_the_function():
  reg: Registry = Registry("loss", plural="losses")

  @reg.register("b_second")
  def b(x):
    return x

  @reg.register("a_first")
  def a(x):
    return -x

  assert b(1) == 1 and a(1) == -1  # still the plain functions
  assert reg.get("a_first") is a and reg.get("b_second") is b
  assert reg.names() == ["a_first", "b_second"]  # sorted, not in registration order


def test_unknown_name_names_the_key_and_lists_the_known_ones_sorted():
  reg: Registry = Registry("reward")
  reg.register("zeta", _double)
  reg.register("alpha", _triple)
  with pytest.raises(UnknownNameError) as info:
    reg.get("gamma")
  assert str(info.value) == "unknown reward 'gamma'; known rewards: ['alpha', 'zeta']"
  # A KeyError, so callers that catch the dict-style error keep working.
  with pytest.raises(KeyError, match=re.escape("known rewards: ['alpha', 'zeta']")):
    reg.get("gamma")


def test_plural_words_the_known_list():
  reg: Registry = Registry("data.format", plural="formats")
  with pytest.raises(KeyError) as info:
    reg.get("csv")
  assert str(info.value) == "unknown data.format 'csv'; known formats: []"


def test_a_different_object_under_a_taken_name_raises():
  reg: Registry = Registry("task")
  reg.register("x", _double)
  with pytest.raises(DuplicateNameError) as info:
    reg.register("x", _triple)
  assert str(info.value).startswith("task 'x' is registered twice: <function _double")
  assert isinstance(info.value, ValueError)
  with pytest.raises(DuplicateNameError):
    reg.register("x")(_triple)  # the decorator form too
  assert reg.get("x") is _double  # the first registration stands


def test_registering_the_same_object_again_is_a_no_op():
  reg: Registry = Registry("task")
  reg.register("x", _double)
  assert reg.register("x", _double) is _double
  assert reg.register("x")(_double) is _double
  assert reg.names() == ["x"] and reg.get("x") is _double


@dataclasses.dataclass(frozen=True)
class _Record:
  name: str
  fn: object


def test_an_equal_record_counts_as_the_same_object():
  """A wrapper that rebuilds the same frozen record (rewards do) may register it again."""
  reg: Registry = Registry("reward")
  first = _Record("r", _double)
  reg.register("r", first)
  reg.register("r", _Record("r", _double))
  assert reg.get("r") is first
  with pytest.raises(DuplicateNameError):
    reg.register("r", _Record("r", _triple))


def test_project_registries_keep_their_messages():
  """Each ported registry still names the unknown key and what exists."""
  from jax_dora.data.formats import get_format
  from jax_dora.learner.losses import OBJECTIVES
  from jax_dora.rewards import get_reward
  from jax_dora.tasks import get_task

  with pytest.raises(KeyError, match=r"unknown data\.format 'csv'; known formats: \['deepscaler', "
                     r"'gsm8k', 'math', 'plain'\]"):
    get_format("csv")
  with pytest.raises(KeyError, match=r"unknown loss 'ppo2'; known losses: \['cispo', "
                     r"'decoupled_ppo', 'grpo', 'gspo', 'sft'\]"):
    OBJECTIVES.get("ppo2")
  with pytest.raises(KeyError, match=r"unknown reward 'nope'; known rewards: \[.*'math_verify'"):
    get_reward("nope")
  with pytest.raises(KeyError, match=r"unknown task 'multiply'; known tasks: \[.*'repeat'"):
    get_task("multiply")
