"""Synthetic verifiable-reward tasks with long-tailed answer lengths.

Usage::

  task = get_task("repeat")
  p = task.make_prompt(0, np.random.default_rng([seed, index]))
  reward = task.score(p, completion_text)   # shaped, in [0, 1]

  mix = TaskMixture(["repeat", "add"], [0.7, 0.3], max_answer_len=48)

See ``base`` for the reward shaping and ``long_tail`` for the length law.
"""

from jax_dora.tasks import long_tail
from jax_dora.tasks.base import (
    ALLOWED_CHARS,
    DEFAULT_MAX_ANSWER_LEN,
    DEFAULT_MAX_PROMPT_LEN,
    Task,
    TaskMixture,
    char_accuracy,
    get_task,
    register,
    shaped_score,
    task_names,
)
from jax_dora.tasks.synthetic import AddTask, RepeatTask, ReverseTask, SortTask
from jax_dora.tasks.mul import MulTask
from jax_dora.tasks.padded_repeat import PaddedRepeatTask

__all__ = [
    "PaddedRepeatTask",
    "ALLOWED_CHARS",
    "DEFAULT_MAX_ANSWER_LEN",
    "DEFAULT_MAX_PROMPT_LEN",
    "AddTask",
    "MulTask",
    "RepeatTask",
    "ReverseTask",
    "SortTask",
    "Task",
    "TaskMixture",
    "char_accuracy",
    "get_task",
    "long_tail",
    "register",
    "shaped_score",
    "task_names",
]
