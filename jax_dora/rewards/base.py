"""The reward-function contract and registry.

A reward function maps ``(prompt, completion_text) -> float``. The
:class:`~jax_dora.types.Prompt` carries the record it was built from (a
synthetic task instance or a dataset row): ``answer`` is the ground truth,
``task`` the task or dataset format, ``meta`` anything else. Functions are
chosen by name in ``config.reward.functions``; adding one is one module with
a ``@register`` function plus its import in ``jax_dora.rewards``.

``isolated=True`` marks functions that parse untrusted model output with
heavy machinery (sympy via math_verify): the scorer runs them in worker
processes under a deadline, so a pathological completion can cost one
worker, never the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax_dora.registry import Registry
from jax_dora.types import Prompt

RewardFn = Callable[[Prompt, str], float]


@dataclasses.dataclass(frozen=True)
class Reward:
  name: str
  fn: RewardFn
  isolated: bool = False


REWARDS: Registry[Reward] = Registry("reward")


def register(name: str, *, isolated: bool = False) -> Callable[[RewardFn], RewardFn]:
  """Decorator: ``@register("format")`` adds a reward function under ``name``."""

  def wrap(fn: RewardFn) -> RewardFn:
    REWARDS.register(name, Reward(name, fn, isolated))
    return fn

  return wrap


def get_reward(name: str) -> Reward:
  return REWARDS.get(name)


def reward_names() -> list[str]:
  return REWARDS.names()
