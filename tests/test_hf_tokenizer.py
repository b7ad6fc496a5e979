"""HFTokenizer against ``transformers``' own chat templating and encoding.

The tokenizer is a byte-level BPE trained here with ``tokenizers`` and given
a ChatML template; ``transformers``' ``apply_chat_template`` and ``encode``
on the same files are the oracle.
"""

from __future__ import annotations

import os

import pytest
import transformers

from jax_dora.model.hf_tokenizer import HFTokenizer, TokenizerLoadError

PROMPTS = ["What is 12 + 30?", "Natalia sold clips to 48 of her friends. Ünïcödé ✓ too.", "  spaces\n"]


def _reference_ids(tok_dir, messages):
  t = transformers.AutoTokenizer.from_pretrained(tok_dir)
  out = t.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("text", PROMPTS)
def test_chat_prompt_equals_apply_chat_template(hf_dirs, text):
  tok_dir = hf_dirs["qwen2"]
  suffix = " Put the final answer after ####."
  ours = HFTokenizer(tok_dir, "chat", system_prompt="You are a helpful assistant.", prompt_suffix=suffix)
  ref = _reference_ids(tok_dir, [{"role": "system", "content": "You are a helpful assistant."},
                                 {"role": "user", "content": text + suffix}])
  assert ours.encode_prompt(text).tolist() == ref
  assert ours.render_prompt(text).endswith("<|im_start|>assistant\n")
  plain = HFTokenizer(tok_dir, "chat")
  assert plain.encode_prompt(text).tolist() == _reference_ids(tok_dir, [{"role": "user", "content": text}])


def test_raw_prompt_and_plain_encode_equal_transformers_encode(hf_dirs):
  tok_dir = hf_dirs["qwen2"]
  t = transformers.AutoTokenizer.from_pretrained(tok_dir)
  ours = HFTokenizer(tok_dir, "raw", prompt_suffix="\nAnswer:")
  for text in PROMPTS:
    assert ours.encode_prompt(text).tolist() == t.encode(text + "\nAnswer:")
    ids, n = ours.encode(text, max_prefill_length=64)
    assert ids[:n].tolist() == t.encode(text, add_special_tokens=False)
    assert n == len(t.encode(text, add_special_tokens=False)) and len(ids) == 64
    assert set(ids[n:].tolist()) <= {ours.pad_id}


def test_stop_ids_decode_and_suppressed_ids(hf_dirs):
  tok_dir = hf_dirs["qwen2"]
  t = transformers.AutoTokenizer.from_pretrained(tok_dir)
  ours = HFTokenizer(tok_dir, "chat")
  im_end, eot = t.convert_tokens_to_ids("<|im_end|>"), t.convert_tokens_to_ids("<|endoftext|>")
  im_start, reserved = t.convert_tokens_to_ids("<|im_start|>"), t.convert_tokens_to_ids("<|reserved_0|>")
  # generation_config.json lists both stop ids; the first is the EOS.
  assert ours.stop_tokens == {im_end, eot} and ours.eos_id == im_end
  body = t.encode("The answer is 42", add_special_tokens=False)
  assert ours.decode(body + [im_end] + t.encode(" ignored", add_special_tokens=False)) == "The answer is 42"
  assert ours.decode(body + [eot]) == "The answer is 42"
  assert ours.decode([im_start] + body) == "The answer is 42"  # specials skipped
  # Non-stop specials and the padded vocabulary rows are never sampled.
  assert ours.suppressed_ids(len(t) + 20) == {im_start, reserved} | set(range(len(t), len(t) + 20))


def test_missing_or_templateless_tokenizer_is_a_clear_error(hf_dirs, tmp_path):
  with pytest.raises(TokenizerLoadError, match="does not exist"):
    HFTokenizer(str(tmp_path / "nope"))
  d = tmp_path / "notemplate"
  d.mkdir()
  t = transformers.AutoTokenizer.from_pretrained(hf_dirs["tokenizer"])
  t.chat_template = None
  t.save_pretrained(str(d))
  for f in ("chat_template.jinja",):
    if os.path.exists(d / f):
      os.remove(d / f)
  with pytest.raises(TokenizerLoadError, match="no chat template"):
    HFTokenizer(str(d), "chat")
  assert HFTokenizer(str(d), "raw").stop_tokens == {t.eos_token_id}
  (d / "generation_config.json").write_text("{not json")
  with pytest.raises(TokenizerLoadError, match="generation_config.json"):
    HFTokenizer(str(d), "raw")


def test_gemma_conventions_bos_first_once_and_end_of_turn_stops(hf_dirs):
  """Gemma's tokenizer adds BOS to every encoding and its chat template writes one too:
  the prompt has exactly one, first (ids written by hand from the vocabulary, not
  re-derived by the code under test); the generation config names only ``<eos>``, yet
  ``<end_of_turn>``, which closes every chat turn, stops a completion."""
  tok_dir = hf_dirs["gemma3"]
  vocab = transformers.AutoTokenizer.from_pretrained(tok_dir).get_vocab()
  bos, eos, eot, sot = (vocab[t] for t in ("<bos>", "<eos>", "<end_of_turn>", "<start_of_turn>"))
  chat = HFTokenizer(tok_dir, "chat").encode_prompt("What is 2 + 2?").tolist()
  assert chat[0] == bos and chat.count(bos) == 1 and chat[1] == sot
  raw = HFTokenizer(tok_dir, "raw").encode_prompt("What is 2 + 2?").tolist()
  assert raw[0] == bos and raw.count(bos) == 1
  tok = HFTokenizer(tok_dir, "chat")
  assert tok.stop_tokens == {eos, eot}
  assert eot not in tok.suppressed_ids(512) and bos in tok.suppressed_ids(512)
  answer = tok.encode_ids("4")
  assert tok.decode([*answer, eot, *answer]) == "4"
  # A raw (base-model) prompt has no chat turns: only <eos> stops it.
  assert HFTokenizer(tok_dir, "raw").stop_tokens == {eos}
