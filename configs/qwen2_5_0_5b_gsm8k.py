"""Qwen2.5-0.5B-Instruct on GSM8K with math-verify rewards: one TPU/GPU host (or Colab TPU).

Get the checkpoint and data once (needs internet; see jax_dora/fetch.py)::

  python -m jax_dora.fetch --model=Qwen/Qwen2.5-0.5B-Instruct --dataset=gsm8k --out=.

then train::

  python -m jax_dora.train --config=configs/qwen2_5_0_5b_gsm8k.py

Layout for one 8-chip host (v5litepod-8, v4-8, Colab's v2-8): the learner
takes 4 chips (FSDP), two rollout servers 2 chips each. On a single-chip
runtime, learner and servers share the chip: ``--config.learner.num_devices=1
--config.rollout.num_servers=1 --config.rollout.devices_per_server=1``.
Everything here is the same code the CPU tests run on a tiny Qwen2 model;
this exact config has not been run on an accelerator in CI (no checkpoint
download there).
"""

from jax_dora.config import base_config, hf_model_config


def get_config():
  c = base_config()
  c.mode = "dora_pace"
  c.output_dir = "runs/qwen2_5_0_5b_gsm8k"
  c.precompile = True
  c.total_steps = 300
  c.model = hf_model_config(
      "checkpoints/Qwen2.5-0.5B-Instruct", max_seq_len=1024,
      param_dtype="float32", dtype="bfloat16")
  c.data.train_files = "data/gsm8k/train.parquet"
  c.data.eval_files = "data/gsm8k/test.parquet"
  c.data.format = "gsm8k"
  c.data.prompt_template = "chat"
  c.data.prompt_suffix = "\nLet's think step by step and output the final answer after \"####\"."
  c.reward.functions = "math_verify,format"
  c.reward.weights = "1.0,0.1"
  c.reward.num_workers = 8
  c.rollout.update(dict(num_servers=2, devices_per_server=2, slots=64, max_prefill_length=256,
                        max_new_tokens=512, max_versions=3, temperature=1.0,
                        param_dtype="bfloat16"))
  c.learner.update(dict(
      num_devices=4, mesh_data=1, mesh_fsdp=-1, group_size=8, groups_per_step=16,
      learning_rate=1e-6, warmup_steps=10, weight_decay=0.0, grad_clip=1.0, kl_coef=0.0,
      micro_batch_size=32, group_micro_batches_by_length=True, logprob_chunk_size=256,
      remat="dots", seq_len_buckets="384,640"))
  c.orchestrator.max_staleness = 4
  c.pace.target_pool_groups = 16
  c.pace.max_budget = 8
  c.eval.num_prompts = 256
  c.eval.every_steps = 25
  c.checkpoint.every_steps = 50
  return c
