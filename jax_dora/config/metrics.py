"""``config.metrics``: where per-step records go besides metrics.jsonl."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, ConfigError, choice, field

WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class MetricsConfig(ConfigBlock):
  """metrics.jsonl is always written (the audit, the benchmarks and the report read it)."""

  BLOCK = "metrics"

  tensorboard: bool = field(True, "TensorBoard event files in <output_dir>/tensorboard.")
  wandb_project: str = field("", "Weights & Biases project (\"\" = no W&B).")
  wandb_entity: str = field("", "W&B entity.")
  wandb_mode: str = field(
      "online", "online | offline (no network: `wandb sync` uploads later) | disabled.")
  num_text_samples: int = field(4, "Decoded completions logged as text.")
  text_every_steps: int = field(10, "Log them every this many steps (0 = never).")

  def __post_init__(self):
    choice(self.BLOCK, "wandb_mode", self.wandb_mode, WANDB_MODES)
    if self.num_text_samples < 0 or self.text_every_steps < 0:
      raise ConfigError("config.metrics.num_text_samples and text_every_steps must be >= 0")
