"""``config.sft``: supervised fine-tuning (``python -m jax_dora.sft``).

SFT shares every other block with RL: ``data`` (files, format, chat
template), ``model``, ``learner`` (with ``learner.loss=sft``), ``checkpoint``,
``metrics`` and ``eval`` (``eval.num_prompts`` held-out prompts decoded
greedily every ``eval.every_steps`` steps). Only what RL has no use for lives
here.
"""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, choice, field

EXPORT_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class SftConfig(ConfigBlock):
  """Targets, batch size, held-out loss and the final Hugging Face export."""

  BLOCK = "sft"

  target_field: str = field(
      "", "Row field holding the completion to learn; \"\" = data.answer_field, else the"
      " format's answer field (gsm8k: the worked solution ending #### N).")
  batch_size: int = field(32, "Rows per optimizer step.")
  eval_loss_rows: int = field(256, "Held-out rows whose mean token loss is logged at every eval.")
  export_dir: str = field("", "Where the final HF checkpoint goes; \"\" = <output_dir>/hf.")
  export_dtype: str = field("float32", "Storage dtype of the export: float32 | bfloat16.")

  def __post_init__(self):
    choice(self.BLOCK, "export_dtype", self.export_dtype, EXPORT_DTYPES)
    if self.batch_size < 1 or self.eval_loss_rows < 0:
      self.fail("batch_size", "batch_size must be >= 1 and eval_loss_rows >= 0")
