"""A Hugging Face tokenizer behind jax-dora's tokenizer contract.

Loaded from a local model directory (``tokenizer.json`` /
``tokenizer_config.json``, the chat template inside it) through
``transformers.AutoTokenizer``, so prompts are built exactly as the model's
authors specified, including the chat template's Jinja extensions. Nothing is
downloaded: ``local_files_only`` is always set.

Stop ids come from ``generation_config.json`` (``eos_token_id``, an int or a
list: Llama 3 Instruct stops on ``<|eot_id|>`` and ``<|eom_id|>`` as well as
``<|end_of_text|>``), falling back to the tokenizer's EOS; with the chat
template, the turn terminator it writes (Gemma's ``<end_of_turn>``,
``CHAT_TURN_ENDS``) is a stop id too, even where a checkpoint's generation
config names only ``<eos>``: a chat model ends its answer there. Every special
token that is not a stop id, and every embedding row past the tokenizer's
length (HF checkpoints pad the vocabulary to a multiple of 64 or 128), is
suppressed at sampling.

BOS: a tokenizer that adds one to every encoding (Gemma's, Llama's) gets it
first in every prompt exactly once, whether the chat template writes it or
not; Gemma degrades badly without it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from jax_dora.model.tokenizer import PolicyTokenizer

_log = logging.getLogger(__name__)

PROMPT_TEMPLATES = ("chat", "raw")
# Special tokens that close a chat turn: a stop id when the chat template writes them.
CHAT_TURN_ENDS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")


class TokenizerLoadError(ValueError):
  """The tokenizer files in a model directory are missing or unusable."""


def _stop_ids_from_generation_config(path: str) -> list[int]:
  file = os.path.join(path, "generation_config.json")
  if not os.path.exists(file):
    return []
  try:
    with open(file) as f:
      eos = json.load(f).get("eos_token_id")
  except (OSError, json.JSONDecodeError) as e:
    raise TokenizerLoadError(f"{file}: unreadable generation config: {e}") from e
  if eos is None:
    return []
  return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


class HFTokenizer(PolicyTokenizer):
  """``transformers`` tokenizer with prompt templating, stop ids and suppression.

  Args:
    path: Local directory holding the tokenizer files (usually the model
      directory).
    prompt_template: ``"chat"`` renders ``[system?, user]`` messages through
      the tokenizer's chat template with the generation prompt appended;
      ``"raw"`` encodes the text itself (plus the tokenizer's own special
      tokens, e.g. Llama's BOS).
    system_prompt: Optional system message (chat only).
    prompt_suffix: Appended to every prompt text, e.g. an instruction on the
      answer format ("... put the final answer in \\boxed{}").
  """

  def __init__(
      self,
      path: str,
      prompt_template: str = "chat",
      system_prompt: str = "",
      prompt_suffix: str = "",
  ):
    if prompt_template not in PROMPT_TEMPLATES:
      raise ValueError(f"prompt_template={prompt_template!r} is not one of {PROMPT_TEMPLATES}")
    if not os.path.isdir(path):
      raise TokenizerLoadError(f"tokenizer directory {path} does not exist")
    try:
      from jax_dora.model.hf_lib import import_transformers  # pylint: disable=g-import-not-at-top

      transformers = import_transformers()

      self._tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise TokenizerLoadError(f"cannot load a tokenizer from {path}: {type(e).__name__}: {e}") from e
    self.path = path
    self.prompt_template = prompt_template
    self.system_prompt = system_prompt
    self.prompt_suffix = prompt_suffix
    if prompt_template == "chat" and not getattr(self._tok, "chat_template", None):
      raise TokenizerLoadError(
          f"{path} has no chat template: use data.prompt_template=raw for a base model")
    stops = _stop_ids_from_generation_config(path)
    if not stops and self._tok.eos_token_id is not None:
      stops = [int(self._tok.eos_token_id)]
    if not stops:
      raise TokenizerLoadError(
          f"{path}: no EOS id in generation_config.json or the tokenizer: a completion could never stop")
    if prompt_template == "chat":
      template = str(self._tok.chat_template)
      specials = set(self._tok.all_special_tokens)
      for token in CHAT_TURN_ENDS:
        if token in template and token in specials:
          stops.append(int(self._tok.convert_tokens_to_ids(token)))
    self._stops = set(stops)
    self._eos = stops[0]
    pad = self._tok.pad_token_id
    self._pad = int(pad) if pad is not None else self._eos
    bos = self._tok.bos_token_id
    self._bos = int(bos) if bos is not None else -1
    # Whether the tokenizer itself starts every encoding with BOS (its post-processor).
    probe = self._tok("a", add_special_tokens=True)["input_ids"]
    self._bos_first = self._bos >= 0 and bool(probe) and probe[0] == self._bos

  # ------------------------------------------------------------- properties
  @property
  def hf_tokenizer(self) -> Any:
    return self._tok

  @property
  def vocab_size(self) -> int:
    return len(self._tok)

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def bos_id(self) -> int:
    return self._bos

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._stops)

  def suppressed_ids(self, model_vocab_size: int) -> set[int]:
    special = set(int(i) for i in self._tok.all_special_ids) - self._stops
    if self._pad not in self._stops:
      special.add(self._pad)
    return {i for i in special if i < model_vocab_size} | set(
        range(self.vocab_size, int(model_vocab_size)))

  # --------------------------------------------------------------- encoding
  def encode_ids(self, s: str) -> np.ndarray:
    """Plain text, no special tokens, no template."""
    return np.asarray(self._tok(s, add_special_tokens=False)["input_ids"], np.int32)

  def encode_text(self, s: str) -> np.ndarray:
    """Untrusted text: special-token strings are split into ordinary tokens.

    transformers' ``split_special_tokens`` (the ``tokenizers`` library's
    ``encode_special_tokens``) tokenises ``<|im_end|>`` in a tool's output as
    the characters it is, so it decodes back to the same text and can neither
    stop the trajectory nor open a forged turn.
    """
    return np.asarray(
        self._tok(s, add_special_tokens=False, split_special_tokens=True)["input_ids"], np.int32)

  def render_prompt(self, text: str) -> str:
    """The prompt string the model sees (chat template applied, suffix added)."""
    content = text + self.prompt_suffix
    if self.prompt_template == "raw":
      return content
    messages = []
    if self.system_prompt:
      messages.append({"role": "system", "content": self.system_prompt})
    messages.append({"role": "user", "content": content})
    return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

  def encode_prompt(self, text: str) -> np.ndarray:
    """Ids of the rendered prompt.

    A chat template writes its own special tokens (BOS included), so the
    rendered string is encoded without adding any; a raw prompt gets the
    tokenizer's usual ones (Llama's BOS).
    """
    rendered = self.render_prompt(text)
    add_special = self.prompt_template == "raw"
    ids = list(self._tok(rendered, add_special_tokens=add_special)["input_ids"])
    if self._bos_first:  # exactly one BOS, first (a template without it, or one that doubles it)
      while ids and ids[0] == self._bos:
        ids.pop(0)
      ids.insert(0, self._bos)
    return np.asarray(ids, np.int32)

  def decode(self, token_ids: Iterable[int] | np.ndarray, **kwargs) -> str:
    """Completion text up to the first stop id, special tokens skipped."""
    del kwargs
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1).tolist()
    for i, t in enumerate(ids):
      if t in self._stops:
        ids = ids[:i]
        break
    return self._tok.decode(ids, skip_special_tokens=True)

  def save(self, out_dir: str) -> None:
    """Writes the tokenizer files (for exported checkpoints)."""
    self._tok.save_pretrained(out_dir)
