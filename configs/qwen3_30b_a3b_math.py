"""A mixture-of-experts policy (Qwen3-30B-A3B) on MATH-style data: TPU v5p slices (issue 26).

Launch with ``launchers/launch_run.sh --config=configs/qwen3_30b_a3b_math.py``
(learner slice: every worker runs jax_dora.train; rollout slices: one server
per worker on its 4 chips). Copy the HF checkpoint to every worker first, e.g.
``gsutil -m cp -r gs://BUCKET/Qwen3-30B-A3B /tmp/``. Not run here: the same
code paths run on CPU with a tiny random Qwen3-MoE (tests/test_moe.py,
tests/test_hf_models.py).

The model: 30.5B parameters, 3.3B active per token; 48 layers, every one
MoE with 128 experts of width 768, top-8 (renormalised); 32 query / 4 KV
heads of 128; vocabulary 151,936.

Sizing (v5p: 95 GiB HBM per chip, 4 chips per host):
  * learner, v5p-32 (16 chips, 1.5 TB): float32 params (122 GB) + Adam moments
    (244 GB) + float32 gradients (122 GB) = 488 GB, FSDP over all 16 chips
    (30.5 GB/chip), bf16 activations with full remat, 32-row micro-batches cut
    by length. A v5p-16 (8 chips, 61 GB/chip of state) would leave too little
    for 4k-token activations; v5e (16 GiB/chip) needs 64+ chips for the state
    alone. Experts are split by FSDP on their embed axis; an ``expert`` mesh
    axis (expert parallelism) is issue 26's next step.
  * rollout, v5p-8 per server (4 chips): tensor parallelism 4 (the 4 KV heads
    bound it: each chip holds one KV head; the 128 experts split 32 per chip),
    bf16 weights 61 GB per live version; up to 3 live versions (DORA) = 183 GB
    = 46 GB/chip, KV cache of 128 slots x 4,096 tokens at 96 KiB/token (4 KV
    heads x 128 x 48 layers x 2 x bf16) = 50 GB = 12.6 GB/chip: 58 of 95 GiB.
    Four such servers (v5p-32 of rollout) keep the learner fed at a 3:1 rollout
    share, the regime RL post-training reports (50-80% of a step in rollout).
  * routing: ``learner.moe_routing`` (recompute | replay) is the next part of
    issue 26; until then the learner recomputes routing, and ``learner.loss=gspo``
    (sequence-level ratio) is the published remedy for the train/inference route
    mismatch of MoE RL that is already available.
"""

from jax_dora.config import base_config, hf_model_config


def get_config():
  c = base_config()
  c.mode = "dora_pace"
  c.role = "learner"
  c.precompile = True
  c.progress_bar = False
  c.output_dir = "gs://CHANGE-ME/jax-dora/qwen3_30b_a3b_math"
  c.total_steps = 1000
  c.distributed.enabled = True
  c.model = hf_model_config(
      "/tmp/Qwen3-30B-A3B", max_seq_len=4608, param_dtype="float32", dtype="bfloat16")
  c.data.train_files = "gs://CHANGE-ME/data/math/train.jsonl"
  c.data.eval_files = "gs://CHANGE-ME/data/math/test.jsonl"
  c.data.format = "math"
  c.data.prompt_template = "chat"
  c.data.prompt_suffix = "\nPlease reason step by step, and put your final answer within \\boxed{}."
  c.reward.functions = "math_verify"
  c.reward.num_workers = 16
  c.rollout.update(dict(devices_per_server=4, tensor_parallel=4, slots=128,
                        max_prefill_length=512, max_new_tokens=4096, max_versions=3,
                        param_dtype="bfloat16"))
  c.learner.update(dict(
      num_devices=-1, mesh_data=1, mesh_fsdp=-1, mesh_tensor=1, group_size=16,
      groups_per_step=32, learning_rate=1e-6, warmup_steps=20, grad_clip=1.0,
      micro_batch_size=32, group_micro_batches_by_length=True, logprob_chunk_size=512,
      remat="full", loss="gspo", moe_aux_loss_coef=-1.0,
      seq_len_buckets="1024,2048,3072,4608"))
  c.orchestrator.max_staleness = 4
  c.pace.target_pool_groups = 32
  c.pace.max_budget = 16
  c.eval.num_prompts = 500
  c.eval.every_steps = 50
  c.checkpoint.every_steps = 50
  return c
