"""``config.tools``: multi-turn tool use (issue 25): which tool, and its limits."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, field
from jax_dora.csv_fields import split_csv


@dataclasses.dataclass(frozen=True)
class ToolsConfig(ConfigBlock):
  """A trajectory may call a tool mid-generation; the observation is appended as context."""

  BLOCK = "tools"

  name: str = field(
      "", "Tool the policy may call (jax_dora.tools: calculator | python); \"\" = single-turn.")
  stop_strings: str = field(
      "", "Comma-separated tool-call end markers; \"\" = the tool's own (calculator \"=\","
      " python a closing ``` fence).")
  max_calls: int = field(4, "Tool calls per trajectory; a later call gets no observation.")
  max_observation_tokens: int = field(
      64, "Observation tokens appended per call (longer ones are cut, and say so).")
  max_turn_tokens: int = field(
      0, "Tokens one turn may sample (a turn reaching it ends the trajectory, finish_reason"
      " length); 0 = only the trajectory's budget (rollout.max_new_tokens) bounds a turn.")
  timeout_s: float = field(5.0, "Wall-clock limit of one call (the python sandbox's CPU limit too).")
  memory_mb: int = field(512, "Memory limit of one python call.")
  max_concurrency: int = field(8, "Tool calls running at once (the rest wait, not the event loop).")
  extra_latency_s: float = field(
      0.0, "Added to every call, to model slow environments (agentic workloads).")
  latency_tail_alpha: float = field(
      0.0, "0: every call waits extra_latency_s. > 1: a Pareto draw of this tail exponent"
      " with mean extra_latency_s (cut at 20x), as real environments' latencies are"
      " long-tailed.")

  @property
  def enabled(self) -> bool:
    return bool(self.name)

  @property
  def stop_list(self) -> tuple[str, ...]:
    return tuple(split_csv(self.stop_strings))

  def __post_init__(self):
    if self.max_calls < 0 or self.max_observation_tokens < 1 or self.max_turn_tokens < 0:
      self.fail("max_calls", "needs max_calls >= 0, max_observation_tokens >= 1 and"
                " max_turn_tokens >= 0")
    if self.timeout_s <= 0 or self.memory_mb < 16 or self.max_concurrency < 1:
      self.fail("timeout_s", "needs timeout_s > 0, memory_mb >= 16 and max_concurrency >= 1")
    if self.extra_latency_s < 0:
      self.fail("extra_latency_s", "must be >= 0")
    if self.latency_tail_alpha and self.latency_tail_alpha <= 1:
      self.fail("latency_tail_alpha", "must be 0 (fixed latency) or > 1 (a finite mean)")
