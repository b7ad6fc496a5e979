"""The long-context workload: long prompts, thousands-of-tokens long-tailed answers.

This is the regime reasoning RL lives in and where DORA's multi-version
streaming matters most: a rollout spans many policy versions while it is
generated. AReaL-style interruption (``async_unfiltered``) aborts every
in-flight rollout at each publish and resumes it on the new version, which
re-prefills prompt + completion-so-far (up to a few thousand tokens) every
time; DORA keeps the rollout on its own version and re-prefills nothing.

* ``padded_repeat`` prompts: a passage of 160-300 characters before the
  instruction (a few hundred tokens);
* answers up to 2047 tokens on a heavy power law (``length_alpha=1.1``,
  measured over 2000 prompts: mean 183, p50 15, p90 670, p99 1830),
  generated exactly (``length_mode="answer"``,
  EOS ignored) so every mode sees the same work;
* small steps (4 groups of 8) so the policy is published often.

Usage: python benchmarks/modes.py --workload=long_context [--budget_s 120]
"""

from jax_dora.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/long_context"
  c.precompile = True
  c.mode = "dora_pace"
  c.total_steps = 200
  c.model.max_seq_len = 2400
  c.rollout.max_prefill_length = 320
  c.rollout.max_new_tokens = 2048
  c.rollout.length_mode = "answer"
  c.rollout.slots = 32
  c.data.tasks = "padded_repeat"
  c.data.task_weights = "1.0"
  c.data.max_prompt_len = 300
  c.data.max_answer_len = 2047
  c.data.length_alpha = 1.1
  c.learner.groups_per_step = 4
  c.learner.seq_len_buckets = "384,512,1024,2400"
  # Rows sorted by length, 8 per micro-batch, each padded to its own bucket:
  # one 2k-token answer no longer makes the other 31 rows pay for 2,400
  # positions (3.8x faster learner steps, benchmarks/learner_throughput.py).
  c.learner.micro_batch_size = 8
  c.learner.group_micro_batches_by_length = True
  # A 2k-token rollout spans many learner versions while it is generated;
  # the bound covers it (below it the tail is evicted and regenerated) and
  # every mode runs with the same bound.
  c.orchestrator.max_staleness = 16
  c.rollout.max_versions = 4
  c.eval.num_prompts = 128
  return c
