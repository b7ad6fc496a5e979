"""The tiny model's multi-turn workload: multiply with a calculator (issue 25).

Usage: python -m jax_dora.train --config=configs/tiny_tools.py
``mul`` prompts ("mul 4821*937:") whose products the 2-layer character model
cannot compute; with ``tools.name=calculator`` it can write "4821*937=", read
"[4517277]" (context: no gradient) and copy it. ``--config.tools.name=`` runs
the same workload without the tool, the baseline the tool must beat.
"""

from jax_dora.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/tiny_tools"
  c.mode = "dora_pace"
  c.total_steps = 100
  c.precompile = True
  c.data.tasks = "mul"
  c.data.task_weights = "1.0"
  c.data.max_answer_len = 12
  c.data.max_prompt_len = 20
  c.rollout.max_prefill_length = 24
  c.rollout.max_new_tokens = 40
  c.model.max_seq_len = 96
  c.learner.seq_len_buckets = "64"
  c.tools.name = "calculator"
  c.tools.max_calls = 2
  c.tools.max_observation_tokens = 16
  # The longest call ("12345678901*999=") is 16 tokens: a turn may not ramble past it.
  c.tools.max_turn_tokens = 16
  return c
