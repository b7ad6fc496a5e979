"""What every config-driven command does around its run: quiet start-up, logs, compile cache, errors.

``python -m jax_dora.train`` and ``python -m jax_dora.sft`` differ only in
the function they run and what they print after it; the start-up (quiet
library output, logging at absl's ``--verbosity``, the persistent compile
cache set before anything compiles) and the mapping of bad input to a
one-line message and exit code 2 are the same, so they live here once.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from absl import flags
import ml_collections

# Exit code for a config or input error: the message names the key or file.
EXIT_BAD_INPUT = 2


def run_config_command(cfg: ml_collections.ConfigDict,
                       run: Callable[[ml_collections.ConfigDict], dict[str, Any]]) -> dict[str, Any]:
  """Sets up logging and the compile cache, then ``run(cfg)``; bad input exits with code 2.

  A config error or a bad input file (checkpoint, tokenizer, dataset) is a
  message that names the key or file, not a traceback that buries it.
  """
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

  configure_logging(verbosity, progress_bar=cfg.progress_bar)
  # Before anything compiles: a second start loads the programs from disk.
  setup_compile_cache(cfg.compile_cache_dir)
  try:
    return run(cfg)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)
  except (CheckpointError, UnsupportedCheckpointError, TokenizerLoadError, DatasetError) as e:
    print(f"input error: {e}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)
