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

import sys

if __name__ == "__main__":
  from jax_dora.runtime import cpu_friendly_env  # pylint: disable=g-import-not-at-top

  cpu_friendly_env()

from absl import app, flags  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/base_model_sft.py", "Path to an SFT config file.", lock_config=True)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jax_dora.quiet import quiet_startup  # pylint: disable=g-import-not-at-top

  verbosity = flags.FLAGS["verbosity"].value if flags.FLAGS["verbosity"].present else None
  quiet_startup(verbose=verbosity is not None and verbosity >= 1)
  from jax_dora.compile_cache import setup_compile_cache  # pylint: disable=g-import-not-at-top
  from jax_dora.config import ConfigError  # pylint: disable=g-import-not-at-top
  from jax_dora.data import DatasetError  # pylint: disable=g-import-not-at-top
  from jax_dora.model.families import UnsupportedCheckpointError  # pylint: disable=g-import-not-at-top
  from jax_dora.model.hf_checkpoint import CheckpointError  # pylint: disable=g-import-not-at-top
  from jax_dora.model.hf_tokenizer import TokenizerLoadError  # pylint: disable=g-import-not-at-top
  from jax_dora.runtime import configure_logging  # pylint: disable=g-import-not-at-top
  from jax_dora.sft_trainer import run_sft  # pylint: disable=g-import-not-at-top

  configure_logging(verbosity, progress_bar=_CONFIG.value.progress_bar)
  setup_compile_cache(_CONFIG.value.compile_cache_dir)
  try:
    summary = run_sft(_CONFIG.value)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)
  except (CheckpointError, UnsupportedCheckpointError, TokenizerLoadError, DatasetError) as e:
    print(f"input error: {e}", file=sys.stderr)
    sys.exit(2)
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
