"""Reward functions by name, and the scorer that combines and isolates them.

Usage::

  scorer = RewardScorer(["math_verify", "format"], [1.0, 0.1], timeout_s=10)
  r = await scorer.score(prompt, completion_text)

Built-in rewards: ``task`` (synthetic tasks), ``math_verify``, ``format``.
A new reward is one module with a ``@register(name)`` function and an import
line below.
"""

from jax_dora.rewards import builtin  # noqa: F401  (fills the registry)
from jax_dora.rewards.base import Reward, get_reward, register, reward_names
from jax_dora.rewards.scorer import RewardScorer

__all__ = ["Reward", "RewardScorer", "get_reward", "register", "reward_names"]
