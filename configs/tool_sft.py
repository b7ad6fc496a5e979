"""SFT of the shipped base model on tool-integrated traces: it learns to call ``python``.

Issue 37 item 2. The shipped base (``jax_dora/base_model/jax-dora-math-base``)
computes the word problems' small numbers in its head; the tool problems
(``jax_dora.data.tool_word_problems``) end with a multiply of up to four by four
digits, which it cannot. This run fine-tunes it on worked traces that write a
``python`` block, read the ``output`` block the tool returns (masked out of the
loss: the tool writes it) and copy the number into the answer. The held-out
greedy accuracy is measured *with the real tool* (multi-turn evaluation on an
embedded rollout server, sandboxed calls).

Recipe (2-core CPU; the model is not shipped, this writes it in minutes)::

  python -m jax_dora.data.tool_word_problems                 # data/tool_word_problems/
  python -m jax_dora.sft --config=configs/tool_sft.py        # exports runs/tool_sft/hf

then RL from it: ``python -m jax_dora.train --config=configs/tiny_math_tools.py``.
"""

from jax_dora.base_model import SHIPPED_MODEL
from jax_dora.config import base_config, hf_model_config

DATA = "data/tool_word_problems"


def get_config():
  c = base_config()
  c.output_dir = "runs/tool_sft"
  c.seed = 0
  c.precompile = True
  c.total_steps = 300
  c.log_every = 25
  c.model = hf_model_config(SHIPPED_MODEL, max_seq_len=256)
  c.data.train_files = f"{DATA}/sft_train.jsonl"
  c.data.eval_files = f"{DATA}/test.jsonl"
  c.data.format = "gsm8k"
  c.data.prompt_template = "chat"
  c.data.eval_group_field = "difficulty"
  c.reward.functions = "math_verify"
  # The tool the traces call: its call format also says where the observations are in a
  # target (jax_dora.data.sft masks them), and the held-out eval runs it for real.
  c.tools.name = "python"
  c.tools.max_calls = 2
  c.tools.max_observation_tokens = 32
  c.learner.update(dict(
      loss="sft", num_devices=2, learning_rate=5e-4, warmup_steps=20, lr_decay_steps=280,
      lr_final_fraction=0.1, weight_decay=0.01, grad_clip=1.0, micro_batch_size=16,
      group_micro_batches_by_length=True, seq_len_buckets="160,192,224,256"))
  c.sft.batch_size = 32
  c.sft.eval_loss_rows = 256
  c.sft.export_dtype = "float32"
  c.rollout.update(dict(num_servers=1, devices_per_server=1, slots=32, max_prefill_length=128,
                        max_new_tokens=128))
  c.eval.num_prompts = 200
  c.eval.every_steps = 100
  c.checkpoint.every_steps = 100
  c.checkpoint.max_to_keep = 1
  return c
