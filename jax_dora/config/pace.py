"""``config.pace``: PACE's pool target, rejection budget and effective-staleness score."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, ConfigError, choice, field

ON_REJECT = ("regenerate", "drop")


@dataclasses.dataclass(frozen=True)
class PaceConfig(ConfigBlock):
  """PACE knobs; ``jax_dora.orchestrator.pace`` says how each enters the formulas."""

  BLOCK = "pace"

  target_pool_groups: int = field(
      4, "Complete groups the pool may hold beyond the next batch before PACE rejects.")
  gain: float = field(0.5, "Rejection budget per group of excess occupancy (smoothed).")
  min_budget: int = field(0, "Fewest groups rejected per learner step when over target.")
  max_budget: int = field(4, "Most groups rejected per learner step.")
  smoothing: float = field(0.5, "Exponential smoothing of the excess occupancy, in [0, 1).")
  generation_weight: float = field(0.5, "Weight of generation staleness in the score.")
  waiting_weight: float = field(1.0, "Weight of waiting staleness (versions in the pool).")
  on_reject: str = field("regenerate", "regenerate (the prompt is rolled out again) | drop.")
  versions_per_token: float = field(
      0.0, "Expected versions per generated token (prefix-aware generation staleness);"
      " 0 = estimate from the pool.")
  request_latency_versions: float = field(
      -1.0, "Versions every rollout spans whatever its length (admission, prefill, the trip"
      " to the pool): the reference is request_latency_versions + versions_per_token * L."
      " -1 = fit both to the pool (slope and median residual); 0 = the length-only reference.")
  generation_slack: float = field(
      1.0, "Generation staleness a trajectory's length explains before it counts.")

  def __post_init__(self):
    if self.target_pool_groups < 0:
      self.fail("target_pool_groups", "must be >= 0")
    if self.gain < 0:
      self.fail("gain", "must be >= 0")
    if not 0 <= self.min_budget <= self.max_budget:
      raise ConfigError(f"config.pace needs 0 <= min_budget <= max_budget, got {self.min_budget},"
                        f" {self.max_budget}")
    if not 0.0 <= self.smoothing < 1.0:
      self.fail("smoothing", "must be in [0, 1)")
    if self.generation_weight < 0 or self.waiting_weight < 0:
      raise ConfigError("config.pace.generation_weight and waiting_weight must be >= 0")
    choice(self.BLOCK, "on_reject", self.on_reject, ON_REJECT)
    if self.versions_per_token < 0 or self.generation_slack < 0:
      raise ConfigError("config.pace.versions_per_token and generation_slack must be >= 0")
    if self.request_latency_versions < 0 and self.request_latency_versions != -1:
      self.fail("request_latency_versions", "must be >= 0, or -1 to estimate it")
