"""``config.data``: synthetic task mixtures or dataset files, and how prompts are rendered."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, choice, field
from jax_dora.tasks.base import DEFAULT_MAX_ANSWER_LEN, DEFAULT_MAX_PROMPT_LEN
from jax_dora.tasks.long_tail import DEFAULT_ALPHA

PROMPT_TEMPLATES = ("raw", "chat")
ON_BAD_ROW = ("skip", "error")


@dataclasses.dataclass(frozen=True)
class DataConfig(ConfigBlock):
  """Where prompts come from (``jax_dora.data.pipeline``)."""

  BLOCK = "data"

  tasks: str = field("repeat,add,sort,reverse", "Comma-separated synthetic task names.")
  task_weights: str = field(
      "0.4,0.2,0.2,0.2", "Comma-separated mixture weights, same order (normalised; empty ="
      " uniform).")
  seed: int = field(0, "Seeds prompt content and the per-epoch shuffle.")
  eval_seed: int = field(1, "Seeds held-out prompt content.")
  heldout_fraction: float = field(
      0.05, "Share of the prompt-hash space reserved for eval, in (0, 1).")
  max_answer_len: int = field(
      DEFAULT_MAX_ANSWER_LEN, "Longest synthetic answer in characters (<= rollout.max_new_tokens"
      " - 1: answer + EOS).")
  max_prompt_len: int = field(
      DEFAULT_MAX_PROMPT_LEN, "Longest synthetic prompt text (<= rollout.max_prefill_length - 1:"
      " BOS).")
  length_alpha: float = field(
      DEFAULT_ALPHA, "Exponent of the answer-length power law (P(L) ~ L**-alpha);"
      " smaller = heavier tail.")
  num_examples: int = field(1_000_000, "Example indices per epoch.")
  num_epochs: int = field(0, "Passes over them; 0 = repeat forever.")
  train_files: str = field(
      "", "Comma-separated JSONL/Parquet paths; non-empty replaces the synthetic tasks.")
  eval_files: str = field(
      "", "Held-out files; empty = hold out heldout_fraction of the training rows (by text"
      " hash).")
  format: str = field("gsm8k", "Record format: gsm8k | math | deepscaler | plain (jax_dora.data.formats).")
  prompt_field: str = field("", "Override the format's prompt field (\"\" = the format's).")
  answer_field: str = field("", "Override the format's answer field.")
  on_bad_row: str = field("skip", "skip (logged count) | error.")
  eval_group_field: str = field(
      "", "Row field (e.g. difficulty) that splits the eval metrics: eval/<field>=<value>/pass@1"
      " beside the overall ones (\"\" = none).")
  prompt_template: str = field(
      "raw", "How a prompt text becomes model input: raw text (the tiny model; base models) or"
      " the tokenizer's chat template.")
  system_prompt: str = field("", "Chat system message (prompt_template=chat).")
  prompt_suffix: str = field("", "Appended to every prompt.")

  @property
  def uses_files(self) -> bool:
    """Dataset files instead of the synthetic tasks."""
    return bool(self.train_files.strip())

  def __post_init__(self):
    choice(self.BLOCK, "prompt_template", self.prompt_template, PROMPT_TEMPLATES)
    choice(self.BLOCK, "on_bad_row", self.on_bad_row, ON_BAD_ROW)
    if not 0 < self.heldout_fraction < 1:
      self.fail("heldout_fraction", "must be in (0, 1)")
    if self.num_epochs < 0 or self.num_examples < 1:
      self.fail("num_examples", "needs num_examples >= 1 and num_epochs >= 0")
    if self.seed == self.eval_seed:
      self.fail("eval_seed", f"must differ from data.seed (both {self.seed})")
