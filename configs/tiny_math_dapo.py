"""The math time-to-reward workload: RL from the shipped base model with DAPO's dynamic sampling.

Issue 37's single-turn workload for ``benchmarks/time_to_reward.py --workload math``
(and ``benchmarks/modes.py --workload math``): :func:`tiny_math_config` (the main
job's recipe, ``configs/tiny_math.py``) with ``learner.dynamic_sampling`` on, the
same for every mode. Why that one switch:

* The papers' regime is a rollout-dominated synchronous step (50-80% of it).
  On this CPU the tiny base model decodes cheaply and the learner pays ~3x a
  token's forward plus every row's prompt, so the main job's synchronous step
  is learner-bound: measured 12-06 (split placement, 1 core each, 90 s): sync
  bubble 37%, dora_pace 1.50x sync's trained tok/s.
* DAPO's dynamic sampling (drop groups whose 8 members all scored the same,
  draw new prompts until 16 informative groups fill the batch) is what
  GRPO-style recipes run (DAPO, verl, slime), and it makes the rollout do
  ~2-3x the work per trained group: the base solves about a quarter of the
  problems at temperature 1, so many groups are all-wrong (hard problems) or
  all-right (easy ones). Measured the same way: sync bubble 68%, dora_pace
  2.08x sync's tok/s (64% of generated tokens in dropped zero-variance groups,
  in both modes). The difficulty mix (1-6 operations, answers 18-105
  characters) gives each batch its long tail: the synchronous step waits for
  its longest rollout, in every refill round.

Everything else is the main job's: 16 groups x 8 per step at 2e-4, 112 new
tokens, ``max_staleness`` 4 (the benchmark compares 2 and 8 by override).
"""

from jax_dora.base_model.rl_recipe import tiny_math_config


def get_config():
  c = tiny_math_config()
  c.output_dir = "runs/tiny_math_dapo"
  c.learner.dynamic_sampling = True
  return c
