"""A byte-level BPE tokenizer with ChatML specials, trained with ``tokenizers``.

Why these choices: byte-level BPE (GPT-2 / Qwen) never meets an unknown
character; digits are split one per token, as Qwen2's and Llama 3's
pre-tokenizers do, so the model's arithmetic sees place values instead of
arbitrary multi-digit merges; ChatML (``<|im_start|>role ... <|im_end|>``) is
the chat format of the Qwen families the model's architecture comes from, so
``data.prompt_template=chat`` renders prompts exactly as for a Qwen checkpoint.
The result is saved as Hugging Face tokenizer files
(``PreTrainedTokenizerFast``), which ``transformers.AutoTokenizer`` and
``jax_dora.model.hf_tokenizer.HFTokenizer`` load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

# Qwen2.5's ChatML template without tool or system defaults: messages in order,
# then the assistant header when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)


def train_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int = 1024) -> str:
  """Trains the BPE on ``texts`` and writes the HF tokenizer files to ``out_dir``.

  ``<|im_end|>`` is the EOS (an assistant turn ends there: the stop id a
  completion ends on) and ``<|endoftext|>`` the padding, as in Qwen2.5
  Instruct; ``generation_config.json`` lists both as stop ids.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top

  from jax_dora.model.hf_lib import import_transformers  # pylint: disable=g-import-not-at-top

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False),
  ])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(texts, trainer)
  transformers = import_transformers()
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token=IM_END, pad_token=PAD,
      additional_special_tokens=[IM_START])
  fast.chat_template = CHAT_TEMPLATE
  os.makedirs(out_dir, exist_ok=True)
  fast.save_pretrained(out_dir)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [fast.convert_tokens_to_ids(IM_END),
                                fast.convert_tokens_to_ids(PAD)],
               "pad_token_id": fast.convert_tokens_to_ids(PAD)}, f, indent=2)
  return out_dir
