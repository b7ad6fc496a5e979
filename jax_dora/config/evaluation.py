"""``config.eval``: held-out evaluation during training (and ``jax_dora.evaluate``)."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, field


@dataclasses.dataclass(frozen=True)
class EvalConfig(ConfigBlock):
  """The log gets pass@1, pass@k and maj@k (with standard errors) beside the mean reward."""

  BLOCK = "eval"

  every_steps: int = field(10, "Evaluate every this many learner steps (0 = only at the end).")
  num_prompts: int = field(64, "Held-out prompts (0 = no eval).")
  at_start: bool = field(True, "Evaluate version 0 before training.")
  num_samples: int = field(1, "k completions per prompt (pass@k, maj@k).")
  correct_threshold: float = field(
      1.0, "A completion is correct when its reward >= this (the synthetic tasks give partial"
      " credit; 1.0 = exact).")
  greedy: bool = field(
      False, "Argmax decoding, for python -m jax_dora.evaluate only (it starts its own"
      " servers; the in-training eval shares the rollout servers, which sample at"
      " rollout.temperature).")

  def __post_init__(self):
    if self.num_samples < 1:
      self.fail("num_samples", "must be >= 1 (k of pass@k)")
    if self.every_steps < 0 or self.num_prompts < 0:
      self.fail("every_steps", "every_steps and num_prompts must be >= 0")
