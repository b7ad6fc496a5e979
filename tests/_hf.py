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


# Gemma's chat format (the released template's structure: BOS first, the system
# message folded into the first user turn, "model" for the assistant's role,
# every turn closed by <end_of_turn>).
GEMMA_CHAT = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def build_gemma_tokenizer(out_dir: str, vocab_size: int = 300) -> str:
  """A byte-level BPE with Gemma's specials, BOS added to every encoding (as Gemma's
  tokenizer does), its chat template, and a generation config that names only
  ``<eos>``: the ``<end_of_turn>`` stop must come from the chat convention."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=GEMMA_SPECIALS,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS * 4, trainer)
  bos = tok.token_to_id("<bos>")
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)])
  fast = PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
      unk_token="<unk>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
  fast.chat_template = GEMMA_CHAT
  os.makedirs(out_dir, exist_ok=True)
  fast.save_pretrained(out_dir)
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": tok.token_to_id("<eos>"), "bos_token_id": bos,
               "pad_token_id": tok.token_to_id("<pad>")}, f)
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
  elif kind == "gemma2":
    # Untied; local, global, local layers with a window of 5 (the tests' sequences are
    # longer); soft-capping at levels a random model's scores and logits really reach.
    cfg = transformers.Gemma2Config(
        **dict(common, num_hidden_layers=3), head_dim=24, rope_theta=10000.0,
        tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention",
                                          "sliding_attention"],
        sliding_window=5, query_pre_attn_scalar=32, attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0, hidden_activation="gelu_pytorch_tanh")
  elif kind in ("gemma3", "gemma3_b"):
    # Tied; QK-norm; local layers on a 10k RoPE base, global ones on 1M with linear x4
    # scaling. gemma3: local, local, global, local (window 6); gemma3_b: global first,
    # then local, window 4, a final-logit cap, and one key/value head (as Gemma 3 1B:
    # fewer than the tests' 2 tensor-parallel chips, so they are replicated).
    types = (["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
             if kind == "gemma3" else ["full_attention", "sliding_attention"])
    kv = {} if kind == "gemma3" else {"num_key_value_heads": 1}
    cfg = transformers.Gemma3TextConfig(
        **dict(common, num_hidden_layers=len(types), **kv), head_dim=24, tie_word_embeddings=True,
        layer_types=types, sliding_window=6 if kind == "gemma3" else 4,
        query_pre_attn_scalar=20,
        final_logit_softcapping=None if kind == "gemma3" else 2.5,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        hidden_activation="gelu_pytorch_tanh")
    cfg.architectures = ["Gemma3ForCausalLM"]
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
      if kind == "gemma2" and name.endswith(("q_proj.weight", "k_proj.weight")):
        # Scores large enough that the attention soft-cap (1.5) really bends them.
        p.mul_(6.0)
  model = model.to(getattr(torch, dtype)).eval()
  model.save_pretrained(out_dir, max_shard_size="40KB" if shard else "10GB")
  for f in os.listdir(tokenizer_dir):
    shutil.copy2(os.path.join(tokenizer_dir, f), os.path.join(out_dir, f))
  if kind.startswith("gemma"):  # its tokenizer brought its own generation config
    return model
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
