"""``task``: the synthetic tasks' own shaped verifier (``jax_dora.tasks``)."""

from __future__ import annotations

from jax_dora.rewards.base import register
from jax_dora.types import Prompt


@register("task")
def task_reward(prompt: Prompt, completion: str) -> float:
  from jax_dora.tasks import get_task  # pylint: disable=g-import-not-at-top

  return get_task(prompt.task).score(prompt, completion)
