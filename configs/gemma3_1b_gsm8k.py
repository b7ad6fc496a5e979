"""Gemma 3 1B (instruction-tuned) on GSM8K with math-verify rewards: one TPU/GPU host.

Get the checkpoint and data once (needs internet and a Hugging Face token that
accepted Gemma's licence; see jax_dora/fetch.py)::

  HF_TOKEN=... python -m jax_dora.fetch --model=google/gemma-3-1b-it --dataset=gsm8k --out=.

then train::

  python -m jax_dora.train --config=configs/gemma3_1b_gsm8k.py

Everything but the model and the learner's memory settings is the Qwen2.5-0.5B GSM8K recipe
(``configs/qwen2_5_0_5b_gsm8k.py``: dora_pace, math_verify + format, 16 groups of 8, LR 1e-6).

The model (``Gemma3ForCausalLM``, ``model_type`` gemma3_text): 26 layers, hidden 1152, 4 query
heads and 1 KV head of 256, GeGLU 6912, a 262,144-token tied vocabulary, five sliding-window
layers (window 512) per global one, 1.0B parameters of which 0.30B are the embedding.

Sizing for one 8-chip host (v5litepod-8: 16 GiB per chip; v4-8: 32 GiB):

* Learner, 4 chips, FSDP: float32 master weights + Adam moments + gradients are 16 B/param,
  15 GiB, under 4 GiB per chip; the 262k vocabulary makes the log-prob head the largest activation,
  so it is computed 128 positions at a time (``logprob_chunk_size``: 8 rows x 128 x 262,144 x
  4 B = 1 GiB per chunk) with ``remat=dots`` for the blocks.
* Two rollout servers, 2 chips each splitting the slots (``rollout.tensor_parallel=1``: the
  bfloat16 weights, 2 GiB, fit one chip. ``tensor_parallel=2`` also works: the single KV head
  is then replicated on both chips, each computing it for its own two query heads, and every
  chip holds the whole KV cache, so it buys weight memory, not cache memory).
  KV cache: 26 layers x 2 x 256 x 2 B = 26.6 KiB per token, x 64 slots x 1024 positions =
  1.7 GiB per server, 0.85 GiB per chip (every layer keeps all positions; local layers only
  *read* their window: DESIGN.md, Sliding-window attention).
* ``scan_layers`` stays off: the model mixes local and global layers (a static window per layer).

On a single-chip runtime (Colab): ``--config.learner.num_devices=1
--config.rollout.num_servers=1 --config.rollout.devices_per_server=1
--config.rollout.slots=32``. Everything here is the code the CPU tests run on a tiny random
Gemma 3 (sliding window, soft-cap, tied head, BOS and ``<end_of_turn>`` conventions); this exact
config has not been run on an accelerator in CI (no checkpoint download there).
"""

from jax_dora.config import hf_model_config, recipe_beside


def get_config():
  # Same task, rewards, host layout and GRPO settings as the Qwen recipe.
  c = recipe_beside(__file__, "qwen2_5_0_5b_gsm8k")
  c.output_dir = "runs/gemma3_1b_gsm8k"
  c.model = hf_model_config(
      "checkpoints/gemma-3-1b-it", max_seq_len=1024, param_dtype="float32", dtype="bfloat16")
  # The 262k vocabulary: a quarter of the rows per micro-batch, half the positions per log-prob
  # chunk (8 x 128 x 262,144 float32 logits = 1 GiB).
  c.learner.micro_batch_size = 8
  c.learner.logprob_chunk_size = 128
  return c
