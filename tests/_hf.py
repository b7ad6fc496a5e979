"""Tiny Hugging Face checkpoints and tokenizers, built locally for the tests.

Nothing is downloaded: a byte-level BPE tokenizer is trained with
``tokenizers`` on a few math sentences and given a ChatML chat template (the
Qwen2.5 format), and random Llama / Qwen2 / Qwen3 models are written with
``transformers``' own ``save_pretrained`` (sharded into several safetensors
files, so the index path is exercised). ``transformers`` on a CPU torch is
then the independent oracle every parity test compares against.
"""

from __future__ import annotations

import json
import os
import shutil

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|reserved_0|>"]
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "The answer is \\boxed{\\frac{1}{2}} because 2 + 2 = 4 and 3 * 4 = 12.",
    "Let's think step by step and output the final answer after ####.",
    "system user assistant You are a helpful assistant. Solve the problem.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) { } \\boxed",
]


def build_tokenizer(out_dir: str, vocab_size: int = 300) -> str:
  """Trains a byte-level BPE with ChatML specials and saves it as an HF tokenizer."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=SPECIALS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS * 4, trainer)
  fast = PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
      additional_special_tokens=["<|im_start|>", "<|reserved_0|>"])
  fast.chat_template = CHATML
  os.makedirs(out_dir, exist_ok=True)
  fast.save_pretrained(out_dir)
  return out_dir


def model_config(kind: str, vocab_size: int, **overrides):
  """A few-layer config of family ``kind`` exercising GQA and the family's quirks."""
  import transformers

  common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5)
  if kind == "llama":
    cfg = transformers.LlamaConfig(
        **common, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))
  elif kind == "qwen2":
    cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=False)
  elif kind == "qwen3":
    cfg = transformers.Qwen3Config(**common, head_dim=24, rope_theta=1000000.0,
                                   tie_word_embeddings=False)
  elif kind == "qwen3_moe":
    # Layer 0 MoE (4 experts, top-2, renormalised), layer 1 dense (mlp_only_layers).
    cfg = transformers.Qwen3MoeConfig(
        **common, head_dim=24, rope_theta=1000000.0, tie_word_embeddings=False,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.01)
  elif kind == "qwen2_moe":
    # Both layers MoE: 4 experts, top-2 (not renormalised), a shared expert of width 48.
    cfg = transformers.Qwen2MoeConfig(
        **common, rope_theta=1000000.0, tie_word_embeddings=False, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
  else:
    raise ValueError(kind)
  for k, v in overrides.items():
    setattr(cfg, k, v)
  return cfg


def build_model(kind: str, out_dir: str, tokenizer_dir: str, seed: int = 0,
                dtype: str = "float32", shard: bool = True):
  """A random ``kind`` model saved with ``save_pretrained``, tokenizer files beside it.

  The vocabulary is the tokenizer's rounded up to a multiple of 64, as real
  checkpoints pad it: the padded ids must never be sampled. Norm scales and
  biases are perturbed so that they matter in the parity checks.
  """
  import torch
  import transformers

  with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
    n_tok = len(json.load(f)["model"]["vocab"])
  vocab = -(-n_tok // 64) * 64
  torch.manual_seed(seed)
  cfg = model_config(kind, vocab)
  model = transformers.AutoModelForCausalLM.from_config(cfg)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or "bias" in name:
        p.add_(torch.randn_like(p) * 0.1)
      if name.endswith("mlp.gate.weight"):
        # Decisive routing: near-tied experts (the 0.02 init) could be ranked
        # differently by float rounding, and the parity tests would compare
        # different experts.
        p.mul_(30.0)
  model = model.to(getattr(torch, dtype)).eval()
  model.save_pretrained(out_dir, max_shard_size="40KB" if shard else "10GB")
  for f in os.listdir(tokenizer_dir):
    shutil.copy2(os.path.join(tokenizer_dir, f), os.path.join(out_dir, f))
  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    # Two stop ids, as chat models have: end of turn and end of text.
    json.dump({"eos_token_id": [tok.convert_tokens_to_ids("<|im_end|>"),
                                tok.convert_tokens_to_ids("<|endoftext|>")]}, f)
  return model


def reference_logits(model, tokens):
  """float32 logits of ``transformers``' forward pass on ``tokens[B, T]``."""
  import numpy as np
  import torch

  with torch.no_grad():
    out = model.float()(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits
  return out.float().numpy()


def reference_routes(model, tokens, k: int):
  """``[T, moe_layers, k]`` the experts ``transformers``' routers pick for ``tokens[T]``
  (its ``output_router_logits``; top-k of the softmax, in descending order)."""
  import numpy as np
  import torch

  with torch.no_grad():
    out = model.float()(torch.as_tensor(np.asarray(tokens)[None], dtype=torch.long),
                        output_router_logits=True)
  per_layer = [torch.topk(torch.softmax(r.float(), -1), k, dim=-1).indices.numpy()
               for r in out.router_logits]
  return np.stack(per_layer, axis=1)
