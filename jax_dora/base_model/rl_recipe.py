"""RL from the shipped base model on the word problems: the settings, in one place.

``configs/tiny_math.py`` (the main job) and the Colab notebook run the same
recipe; the notebook is installed from a wheel without ``configs/``, so the
settings live in the package and both call :func:`tiny_math_config`.
Everything here is the real-model path: the HF checkpoint import, the
tokenizer's ChatML template, ``math_verify`` on the ``#### N`` answer.
"""

from __future__ import annotations

import os

import ml_collections

from jax_dora.base_model import SHIPPED_MODEL
from jax_dora.config import base_config, hf_model_config

# Where ``python -m jax_dora.data.word_problems`` writes the RL prompts and the held-out split.
DEFAULT_DATA_DIR = "data/word_problems"


def tiny_math_config(data_dir: str = DEFAULT_DATA_DIR) -> ml_collections.ConfigDict:
  """dora_pace RL from :data:`SHIPPED_MODEL` on ``<data_dir>/{rl_train,test}.jsonl``."""
  c = base_config()
  c.output_dir = "runs/tiny_math"
  c.mode = "dora_pace"
  c.precompile = True
  # The main job: about five minutes on the 2-core CPU from a cold compilation cache (start-up
  # and compilation, the held-out eval before and after, 22 steps of 16 groups x 8).
  c.total_steps = 22
  c.log_every = 5
  c.model = hf_model_config(SHIPPED_MODEL, max_seq_len=256)
  c.data.train_files = os.path.join(data_dir, "rl_train.jsonl")
  c.data.eval_files = os.path.join(data_dir, "test.jsonl")
  c.data.format = "gsm8k"
  c.data.prompt_template = "chat"
  c.data.eval_group_field = "difficulty"
  c.reward.functions = "math_verify"
  c.rollout.update(dict(num_servers=2, devices_per_server=1, slots=32, max_prefill_length=144,
                        max_new_tokens=112, max_versions=3, temperature=1.0))
  # 16 groups a step at 2e-4 (12-06, 2-core CPU, one seed each, 200 held-out problems x 4
  # samples): from the first (clean-corpus) base, 4 groups a step collapsed at 3e-4 (pass@1
  # 0.22 -> 0.11) and drifted down at 1.5e-4, and 16 groups at 6e-4 collapsed (0.22 -> 0.08 in
  # 6 minutes): Adam takes lr-sized steps whatever the gradient's noise, so a small batch or a
  # large rate walks the policy off. From the shipped base, 16 at 2e-4 went 0.23 -> 0.39 in 3
  # minutes and 0.45 in 6 (benchmarks/rl_from_base.py; 3 seeds in the README).
  c.learner.update(dict(
      num_devices=2, group_size=8, groups_per_step=16, learning_rate=2e-4, warmup_steps=5,
      micro_batch_size=32, group_micro_batches_by_length=True, seq_len_buckets="128,160,192,256"))
  c.orchestrator.max_staleness = 4
  # max_staleness + 2 versions: the audit re-derives every trained label from its version's
  # snapshot (fewer kept would leave some unverifiable, and warn on the screen).
  c.snapshots.max_to_keep = 6
  c.pace.target_pool_groups = 16
  # Before and after only (mid-run evals share the servers with training).
  c.eval.num_prompts = 200
  c.eval.num_samples = 4
  c.eval.every_steps = 0
  return c
