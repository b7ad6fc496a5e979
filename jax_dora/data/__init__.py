"""Grain prompt pipeline over the synthetic tasks or dataset files (see ``pipeline``)."""

from jax_dora.data.files import DatasetError, RecordTable, read_records
from jax_dora.data.pipeline import (
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
    "is_heldout",
    "load_file_splits",
    "make_eval_prompts",
    "make_mixture",
    "make_prompt_dataset",
    "read_records",
    "uses_files",
]
