"""The benchmark workload: long-tailed, rollout-dominated, identical for every mode.

RL post-training of LLMs spends 50-80% of a synchronous step in rollout, and
the step waits for its longest generation. This config reproduces that regime
on a CPU with the tiny model:

* answers follow a heavy power law up to 255 tokens (``length_alpha=1.1``:
  p50 8, p90 ~114, p99 ~235, mean ~34), so one batch's longest rollout
  (8 prompts: ~130 tokens expected) is many times its mean;
* ``rollout.length_mode="answer"``: every rollout generates exactly its
  answer's length with EOS ignored (vLLM's ``ignore_eos`` benchmarking
  practice), so the length law is the workload's and not whatever the policy
  currently emits, and every mode sees the same work for the whole run (left
  to EOS, the tiny policy collapses to 2-3 token answers within ~20 steps and
  the tail, the thing being measured, disappears);
* the learner pays for the tokens a batch holds, as production learners do
  (packing, length-grouped micro-batches): micro-batches of 16 rows cut from
  the rows sorted by length, each padded to its own bucket. Without that the
  64 rows are all padded to the batch's longest row, so the learner pays for
  the tail exactly like the synchronous rollout does and the rollout share
  cannot rise above about half.

How the balance was chosen (2-core machine, split placement, 12-04/12-05): with
the old workload (answers <= 127, alpha 1.2, one whole-batch learner call)
sync's rollout share was 49-54% and every asynchronous mode was learner-bound
(bubble <= 2%). Halving or quartering the rollout server's slots did not move
it (32 slots decode this workload faster per token than 64 on one core).
Length-grouped micro-batches took sync to 58%; the longer, heavier tail
(255, alpha 1.1) to 62-64%, with async_unfiltered rollout-bound (bubble
19-30%, it re-prefills interrupted rollouts) and dora at the learner bound
(rollout server idle 3-4%). ``benchmarks/modes.py`` prints sync's share and
each mode's bubble from every run.

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
  c.model.max_seq_len = 288
  c.rollout.max_new_tokens = 256
  c.rollout.length_mode = "answer"
  c.data.max_answer_len = 255
  c.data.length_alpha = 1.1
  c.learner.seq_len_buckets = "64,96,128,192,256"
  c.learner.micro_batch_size = 16
  c.learner.group_micro_batches_by_length = True
  # 64 rows per step = the servers' 2 x 32 slots (benchmarks/modes.py's split
  # placement gives its one server all 64): a synchronous batch is one wave
  # whose slots idle as its short members finish.
  c.rollout.slots = 32
  # The bound must cover the learner versions the longest rollout spans while
  # it is generated (a 255-token rollout spans ~12-15 while the learner
  # streams through short ones); below that the tail is evicted and
  # regenerated over and over (measured with dora on the 127-token workload:
  # 23% of generated tokens wasted at 8, 6% at 12). Every mode runs with the
  # same bound.
  c.orchestrator.max_staleness = 16
  c.rollout.max_versions = 4
  c.eval.num_prompts = 512  # held-out reward is compared across modes: keep its noise low
  return c
