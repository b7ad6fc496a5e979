"""The SFT run that made the shipped base model ``jax_dora/base_model/jax-dora-math-base``.

Recipe (the 2-core CPU; timings in the README, "The base model")::

  python -m jax_dora.base_model                               # data, tokenizer, random init
  python -m jax_dora.sft --config=configs/base_model_sft.py   # SFT; exports runs/base_model/sft/hf

then copy ``runs/base_model/sft/hf`` to ``jax_dora/base_model/jax-dora-math-base``
(about 22 minutes in all on the 2-core CPU). A
Qwen3-architecture decoder (``jax_dora.base_model.init.ARCHITECTURE``) with
its own byte-level BPE learns worked solutions of the generated word problems
(``jax_dora.data.word_problems``): greedy accuracy is logged on held-out
prompts every ``eval.every_steps`` steps.
"""

from jax_dora.config import base_config, hf_model_config


def get_config():
  c = base_config()
  c.output_dir = "runs/base_model/sft"
  c.seed = 0
  c.precompile = True
  # The shipped model is step 1000 of this schedule (a cosine decay over 1900 steps after
  # warm-up, sized for 2000). The corpus is a noisy teacher (40% of answer lines miscopied,
  # jax_dora.data.word_problems): run on 12-06, greedy held-out pass@1 (200 prompts) was 0.09 at
  # step 250, 0.10 at 500, 0.16 at 750 and 0.36 at 1000, where temperature-1 pass@1 is 0.23 and
  # 54% of its samples miscopy their answer line: in the 15-45% wanted for a base that RL has
  # room to improve, so the run stops at 1000. (The clean corpus of the first shipped model
  # reached 0.35 at step 750 and 0.52 at 1000.) The same seed and data order reproduce it.
  c.total_steps = 1000
  c.log_every = 50
  c.model = hf_model_config("runs/base_model/init", max_seq_len=256)
  c.data.train_files = "data/word_problems/sft_train.jsonl"
  c.data.eval_files = "data/word_problems/test.jsonl"
  c.data.format = "gsm8k"
  c.data.prompt_template = "chat"
  c.data.eval_group_field = "difficulty"
  c.reward.functions = "math_verify"
  c.learner.update(dict(
      loss="sft", num_devices=2, learning_rate=2e-3, warmup_steps=100, lr_decay_steps=1900,
      lr_final_fraction=0.05, weight_decay=0.01,
      grad_clip=1.0, micro_batch_size=16, group_micro_batches_by_length=True,
      seq_len_buckets="96,128,160,192,256"))
  c.sft.batch_size = 32
  c.sft.eval_loss_rows = 256
  c.sft.export_dtype = "float32"
  # Greedy accuracy on held-out prompts, decoded by one embedded rollout server.
  c.rollout.update(dict(num_servers=1, devices_per_server=1, slots=32, max_prefill_length=128,
                        max_new_tokens=128))
  c.eval.num_prompts = 200
  c.eval.every_steps = 250
  c.checkpoint.every_steps = 250
  c.checkpoint.max_to_keep = 1
  return c
