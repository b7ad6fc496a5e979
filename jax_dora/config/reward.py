"""``config.reward``: which rewards score a completion, and how they are run."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, ConfigError, field
from jax_dora.csv_fields import split_csv


@dataclasses.dataclass(frozen=True)
class RewardConfig(ConfigBlock):
  """Rewards by name (``jax_dora.rewards``), summed with weights."""

  BLOCK = "reward"

  functions: str = field(
      "task", "Comma-separated reward names: task scores synthetic prompts with their own"
      " verifier; math_verify checks the final answer of math datasets; format rewards a"
      " well-formed final answer. Weighted sum.")
  weights: str = field("", "Comma-separated weights, same order; empty = all 1.0.")
  timeout_s: float = field(
      5.0, "Verifiers that parse model output run in worker processes, each answer with this"
      " deadline: a pathological completion scores 0 (counted in the metrics) instead of"
      " hanging the run.")
  num_workers: int = field(2, "Verifier worker processes.")
  overlong_buffer: int = field(
      0, "DAPO's soft overlong punishment: completions longer than max_new_tokens -"
      " overlong_buffer lose up to overlong_penalty, linearly over the buffer (0 = off).")
  overlong_penalty: float = field(1.0, "Largest overlong punishment.")

  @property
  def names(self) -> list[str]:
    return split_csv(self.functions)

  @property
  def weight_list(self) -> list[float] | None:
    return split_csv(self.weights, float) or None

  def __post_init__(self):
    from jax_dora.rewards import reward_names  # pylint: disable=g-import-not-at-top

    names = self.names
    unknown = [n for n in names if n not in reward_names()]
    if not names or unknown:
      raise ConfigError(f"config.reward.functions={self.functions!r}: unknown"
                        f" {unknown or '(empty)'}; known rewards: {reward_names()}")
    weights = split_csv(self.weights)
    if weights and len(weights) != len(names):
      raise ConfigError(f"config.reward.weights has {len(weights)} entries for {len(names)}"
                        " functions")
    if self.timeout_s <= 0:
      self.fail("timeout_s", "must be > 0")
    if self.num_workers < 1:
      self.fail("num_workers", "must be >= 1")
    if self.overlong_buffer < 0 or self.overlong_penalty < 0:
      raise ConfigError("config.reward.overlong_buffer and overlong_penalty must be >= 0")
