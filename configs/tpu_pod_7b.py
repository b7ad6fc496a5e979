"""A 7B-class policy (Qwen2.5-7B-Instruct) on MATH-style data: TPU pod slices.

Launch with ``launchers/launch_run.sh --config=configs/tpu_pod_7b.py`` (learner
slice: every worker runs jax_dora.train; rollout slices: one server per
worker on its local chips). The run directory and the dataset files may be
``gs://`` paths; the HF checkpoint is read from a local directory on every
worker (learner workers read the weights, rollout workers only config.json
and the tokenizer), so copy it there first, e.g.
``gsutil -m cp -r gs://BUCKET/Qwen2.5-7B-Instruct /tmp/``.

Sizing (v5e, 16 GiB HBM per chip):
  * learner: float32 params + Adam moments of 7.6B params = 122 GB, FSDP over
    every chip of a v5litepod-64 (~1.9 GB/chip) plus bf16 activations with
    remat, 64-row micro-batches cut by length (each padded to its own
    bucket) and 512-position log-prob chunks;
  * rollout: bf16 weights (15 GB) split 4 ways by tensor parallelism over a
    worker's 4 chips, KV cache of 128 slots x 2,560 tokens (4 KV heads x 128
    dims x 28 layers x 2 bytes x 2 = 57 KB/token: 18.7 GB over 4 chips).

Untested on accelerators in CI (see README): the same code paths are
exercised on CPU with tiny models.
"""

from jax_dora.config import base_config, hf_model_config


def get_config():
  c = base_config()
  c.mode = "dora_pace"
  c.role = "learner"
  c.precompile = True
  c.progress_bar = False
  c.output_dir = "gs://CHANGE-ME/jax-dora/qwen2_5_7b_math"
  c.total_steps = 1000
  c.distributed.enabled = True
  c.model = hf_model_config(
      "/tmp/Qwen2.5-7B-Instruct", max_seq_len=2560, param_dtype="float32", dtype="bfloat16")
  c.data.train_files = "gs://CHANGE-ME/data/math/train.jsonl"
  c.data.eval_files = "gs://CHANGE-ME/data/math/test.jsonl"
  c.data.format = "math"
  c.data.prompt_template = "chat"
  c.data.prompt_suffix = "\nPlease reason step by step, and put your final answer within \\boxed{}."
  c.reward.functions = "math_verify"
  c.reward.num_workers = 16
  c.rollout.update(dict(devices_per_server=4, tensor_parallel=4, slots=128,
                        max_prefill_length=512, max_new_tokens=2048, max_versions=4,
                        param_dtype="bfloat16"))
  c.learner.update(dict(
      num_devices=-1, mesh_data=1, mesh_fsdp=-1, mesh_tensor=1, group_size=16,
      groups_per_step=32, learning_rate=1e-6, warmup_steps=20, grad_clip=1.0,
      micro_batch_size=64, group_micro_batches_by_length=True, logprob_chunk_size=512,
      remat="full",
      seq_len_buckets="1024,1536,2048"))
  c.orchestrator.max_staleness = 4
  c.pace.target_pool_groups = 32
  c.pace.max_budget = 16
  c.eval.num_prompts = 500
  c.eval.every_steps = 50
  c.checkpoint.every_steps = 50
  return c
