"""Supervised fine-tuning: ``python -m jax_dora.sft --config=configs/base_model_sft.py``.

The cold start before RL (and how the project's own base model is made):
masked next-token cross-entropy on the completion tokens of JSONL/Parquet
rows, with the RL learner, data formats, checkpoints and metrics
(:mod:`jax_dora.sft_trainer`). Any field can be overridden with
``--config.<path>=<value>``. The result is a Hugging Face checkpoint
(``sft.export_dir``, default ``<output_dir>/hf``) that ``model.hf_path`` of
an RL run loads.
"""

from __future__ import annotations

if __name__ == "__main__":
  from jax_dora.runtime import cpu_friendly_env  # pylint: disable=g-import-not-at-top

  cpu_friendly_env()

from absl import app  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/base_model_sft.py", "Path to an SFT config file.", lock_config=True)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jax_dora.command import run_config_command  # pylint: disable=g-import-not-at-top
  from jax_dora.sft_trainer import run_sft  # pylint: disable=g-import-not-at-top

  summary = run_config_command(_CONFIG.value, run_sft)
  evals = summary["evals"]
  first, last = (evals[0], evals[-1]) if evals else ({}, {})
  print(f"== sft: {summary['steps']} steps, {summary['target_tokens']} target tokens in"
        f" {summary['train_seconds']:.0f}s ==")
  for key in ("sft/heldout_loss", "sft/greedy_pass@1"):
    if key in last:
      print(f"{key.removeprefix('sft/'):<18} {first.get(key, float('nan')):.3f} -> {last[key]:.3f}")
  print(f"{'exported':<18} {summary['export_dir']}")
  print(f"{'metrics':<18} {summary['metrics_path']}")


def run() -> None:
  from jax_dora.runtime import cpu_friendly_env  # pylint: disable=g-import-not-at-top

  cpu_friendly_env()
  app.run(main)


if __name__ == "__main__":
  run()
