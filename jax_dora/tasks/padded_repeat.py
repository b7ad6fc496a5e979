"""``padded_repeat``: the repeat task behind a long distractor passage.

Reasoning RL has long prompts (a problem statement of a few hundred tokens)
and long, long-tailed answers. This task gives the character model that
shape: a passage of random words, a few hundred characters, followed by the
``repeat`` instruction; the answer is the repetition, its length drawn from
the task's power law (up to ``max_answer_len``, thousands of tokens in
``configs/long_context.py``). The passage is irrelevant to the answer, so
the reward stays ``repeat``'s; what it changes is the cost of a prompt, and
of re-prefilling an interrupted rollout (prompt + completion so far), which
is what the long-context modes benchmark measures.

Format: ``"<passage> rep 300 ab:"`` -> ``"abab..."`` (600 characters).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_dora.tasks.base import LETTERS, Task, register


@register
class PaddedRepeatTask(Task):
  """``repeat`` after a passage filling half to all of ``max_prompt_len``."""

  name = "padded_repeat"

  def generate(self, rng: np.random.Generator) -> tuple[str, str, dict[str, Any]]:
    length = self.sample_length(rng, self.max_answer_len)
    unit_lens = [k for k in (1, 2, 3) if length % k == 0]
    k = unit_lens[int(rng.integers(0, len(unit_lens)))]
    unit = "".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), size=k))
    count = length // k
    instruction = f" rep {count} {unit}:"
    room = self.max_prompt_len - len(instruction)
    if room < 1:
      raise ValueError(f"task {self.name!r}: max_prompt_len={self.max_prompt_len} leaves no"
                       " room for a passage")
    target = int(rng.integers(max(1, room // 2), room + 1))
    words = []
    while sum(len(w) + 1 for w in words) < target:
      n = int(rng.integers(2, 9))
      words.append("".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), size=n)))
    passage = " ".join(words)[:target]
    return passage + instruction, unit * count, {"count": count, "unit": unit,
                                                 "passage_len": len(passage)}
