"""Dataset record formats: which fields hold the prompt and the answer, and how to read the answer.

A format turns one row of a JSONL/Parquet file into ``(prompt_text,
ground_truth)``. ``data.format`` picks one by name; ``data.prompt_field`` /
``data.answer_field`` override its field names. A new format is one
``RecordFormat`` plus a ``register`` line (here or in its own module).

Built-ins:
  * ``gsm8k``: ``question``; ``answer`` is a worked solution ending in
    ``#### 72``: the ground truth is what follows ``####``.
  * ``math``: ``problem``; ``solution`` with the answer in its last
    ``\\boxed{}`` (Hendrycks MATH).
  * ``deepscaler``: ``problem``; ``answer`` already extracted
    (DeepScaleR, Open-R1 math mixes).
  * ``plain``: ``prompt`` / ``answer`` verbatim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax_dora.registry import Registry
from jax_dora.rewards.extract import hash_answer, last_boxed


@dataclasses.dataclass(frozen=True)
class RecordFormat:
  """How to read one dataset row.

  Attributes:
    name: Registry key; also the ``Prompt.task`` of every prompt it makes.
    prompt_field: Row field holding the problem text.
    answer_field: Row field holding the answer / solution.
    extract_answer: Answer field -> ground truth, or None when the row has
      no usable answer (the row is then bad: skipped or an error, see
      ``data.on_bad_row``).
  """

  name: str
  prompt_field: str
  answer_field: str
  extract_answer: Callable[[str], str | None] = lambda s: s.strip() or None


FORMATS: Registry[RecordFormat] = Registry("data.format", plural="formats")


def register(fmt: RecordFormat) -> RecordFormat:
  """Adds ``fmt`` under ``fmt.name``: the key is the name its prompts carry as ``Prompt.task``."""
  return FORMATS.register(fmt.name, fmt)


def get_format(name: str, prompt_field: str = "", answer_field: str = "") -> RecordFormat:
  """Format ``name`` with optional field-name overrides."""
  fmt = FORMATS.get(name)
  return dataclasses.replace(
      fmt, prompt_field=prompt_field or fmt.prompt_field, answer_field=answer_field or fmt.answer_field)


register(RecordFormat("gsm8k", "question", "answer", hash_answer))
register(RecordFormat("math", "problem", "solution", last_boxed))
register(RecordFormat("deepscaler", "problem", "answer"))
register(RecordFormat("plain", "prompt", "answer"))
