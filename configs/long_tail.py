"""The benchmark workload: long-tailed, rollout-dominated, identical for every mode.

RL post-training of LLMs spends most of a synchronous step in rollout, and the
step waits for its longest generation. This config reproduces that regime on a
CPU with the tiny model:

* answers follow a heavier power law up to 127 tokens (``length_alpha=1.2``:
  p50 4, p90 ~52, p99 ~116 for ``repeat``), so one batch's longest rollout is
  many times its mean;
* ``rollout.length_mode="answer"``: every rollout generates exactly its
  answer's length with EOS ignored (vLLM's ``ignore_eos`` benchmarking
  practice), so the length law is the workload's and not whatever the policy
  currently emits, and every mode sees the same work for the whole run (left
  to EOS, the tiny policy collapses to 2-3 token answers within ~20 steps and
  the tail, the thing being measured, disappears);
* training rows are bucketed by length so the learner, like rollout, pays for
  the tokens a batch holds rather than for ``max_seq_len``.

Usage: python benchmarks/modes.py  (uses this config), or
python -m jax_dora.train --config=configs/long_tail.py --config.mode=dora
"""

from jax_dora.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/long_tail"
  c.precompile = True
  c.mode = "dora"
  c.total_steps = 200
  c.model.max_seq_len = 160
  c.rollout.max_new_tokens = 128
  c.rollout.length_mode = "answer"
  c.data.max_answer_len = 127
  c.data.length_alpha = 1.2
  c.learner.seq_len_buckets = "48,64,96,128"
  # 64 rows per step = the servers' 2 x 32 slots: a synchronous batch is one
  # wave whose slots idle as its short members finish.
  c.rollout.slots = 32
  # The bound must cover the learner versions the longest rollout spans while
  # it is generated (a 127-token rollout spans ~9-10 while the learner streams
  # through short ones); below that the tail is evicted and regenerated over
  # and over: measured with dora, 23% of generated tokens wasted at 8, 6% at
  # 12. Every mode runs with the same bound.
  c.orchestrator.max_staleness = 12
  c.rollout.max_versions = 4
  c.eval.num_prompts = 512  # held-out reward is compared across modes: keep its noise low
  return c
