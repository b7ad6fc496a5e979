"""Qwen2.5-0.5B-Instruct on GSM8K with a Python tool: tool-integrated reasoning (issue 25).

Same model, data and rewards as ``configs/qwen2_5_0_5b_gsm8k.py``, but a
trajectory may run code mid-generation: the model writes a fenced ``python``
block, generation stops at its closing fence, the code runs in the contained
sandbox (``jax_dora.tools.python_exec``: namespaces, no network, no access to
the run's files, CPU/memory/time limits) and a fenced ``output`` block with
what it printed is appended as context (no gradient, no behaviour log-prob),
then the same policy version continues (its version is held on its server
while the code runs). Get the checkpoint and data as for the GSM8K config,
then::

  python -m jax_dora.train --config=configs/qwen2_5_0_5b_gsm8k_tir.py

Sizing: tool calls add turns (and their re-prefill) to the long tail, so the
completion budget is larger than the plain config's and the pool target
higher. Not run on an accelerator in CI; tests run it on a tiny Qwen2.
"""

from jax_dora.config import recipe_beside


def get_config():
  c = recipe_beside(__file__, "qwen2_5_0_5b_gsm8k")
  c.output_dir = "runs/qwen2_5_0_5b_gsm8k_tir"
  c.data.prompt_suffix = (
      "\nSolve it step by step. You may run Python: write a ```python code block that prints"
      " what you need; its output comes back in an ```output block. Give the final answer"
      " after \"####\".")
  c.tools.name = "python"
  c.tools.max_calls = 4
  c.tools.max_observation_tokens = 256
  c.tools.timeout_s = 5.0
  c.tools.memory_mb = 1024
  c.tools.max_concurrency = 16
  c.model.max_seq_len = 2048
  c.rollout.max_new_tokens = 1536
  c.rollout.max_prefill_length = 384
  c.learner.seq_len_buckets = "512,1024,1536"
  c.pace.target_pool_groups = 24
  return c
