"""Grain prompt pipeline over the synthetic tasks (see ``pipeline``)."""

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
      )
  )


# Imported after default_data_config so that jax_dora.config can import it
# without pulling in grain first.
from jax_dora.data.pipeline import (  # pylint: disable=g-import-not-at-top,wrong-import-position
    PromptStream,
    config_fingerprint,
    is_heldout,
    make_eval_prompts,
    make_mixture,
    make_prompt_dataset,
)

__all__ = [
    "PromptStream",
    "config_fingerprint",
    "default_data_config",
    "is_heldout",
    "make_eval_prompts",
    "make_mixture",
    "make_prompt_dataset",
]
