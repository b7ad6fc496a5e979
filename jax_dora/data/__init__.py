"""Grain prompt pipeline over the synthetic tasks or dataset files (see ``pipeline``)."""

import ml_collections

from jax_dora.tasks import DEFAULT_MAX_ANSWER_LEN, DEFAULT_MAX_PROMPT_LEN
from jax_dora.tasks.long_tail import DEFAULT_ALPHA


def default_data_config() -> ml_collections.ConfigDict:
  """Defaults for ``cfg.data``; fields are documented in ``pipeline``."""
  return ml_collections.ConfigDict(
      dict(
          tasks="repeat,add,sort,reverse",
          task_weights="0.4,0.2,0.2,0.2",
          seed=0,
          eval_seed=1,
          heldout_fraction=0.05,
          max_answer_len=DEFAULT_MAX_ANSWER_LEN,  # <= rollout.max_new_tokens
          max_prompt_len=DEFAULT_MAX_PROMPT_LEN,  # <= rollout.max_prefill_length - 1
          length_alpha=DEFAULT_ALPHA,
          num_examples=1_000_000,
          num_epochs=0,  # 0 = repeat forever
          # Dataset files (JSONL / Parquet); non-empty train_files replaces the
          # synthetic tasks. eval_files empty = hold out heldout_fraction of
          # the training rows (by text hash).
          train_files="",
          eval_files="",
          format="gsm8k",  # gsm8k | math | deepscaler | plain (jax_dora.data.formats)
          prompt_field="",  # "" = the format's field
          answer_field="",
          on_bad_row="skip",  # skip (logged count) | error
          # How a prompt text becomes model input: "raw" text (the tiny model;
          # base models) or the tokenizer's "chat" template. system_prompt is
          # a chat system message; prompt_suffix is appended to every prompt.
          prompt_template="raw",
          system_prompt="",
          prompt_suffix="",
      )
  )


# Imported after default_data_config so that jax_dora.config can import it
# without pulling in grain first.
from jax_dora.data.files import DatasetError, RecordTable, read_records  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.data.pipeline import (  # pylint: disable=g-import-not-at-top,wrong-import-position
    FileSplits,
    PromptStream,
    config_fingerprint,
    is_heldout,
    load_file_splits,
    make_eval_prompts,
    make_mixture,
    make_prompt_dataset,
    uses_files,
)

__all__ = [
    "DatasetError",
    "FileSplits",
    "PromptStream",
    "RecordTable",
    "config_fingerprint",
    "default_data_config",
    "is_heldout",
    "load_file_splits",
    "make_eval_prompts",
    "make_mixture",
    "make_prompt_dataset",
    "read_records",
    "uses_files",
]
