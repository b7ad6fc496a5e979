"""Main entry point: ``python -m jax_dora.train --config=configs/tiny_math.py`` (the default).

Any field can be overridden with ``--config.<path>=<value>``; unknown keys
are rejected by ml_collections before anything starts.

On a terminal the screen is one progress bar and, at the end, a short summary
(:mod:`jax_dora.summary`) plus ``<output_dir>/report.png``; a log file also
gets the INFO lines. ``--verbosity`` (absl's flag) sets the level: ``0``
start-up and per-step log lines, ``1`` debug logs and the libraries' own
start-up output.
"""

from __future__ import annotations

import os
import sys

# Must happen before JAX initialises its backends (CPU runs get 8 host devices
# so the learner mesh and the rollout servers use disjoint devices).
if __name__ == "__main__" or os.environ.get("JAX_DORA_FORCE_HOST_DEVICES"):
  from jax_dora.runtime import cpu_friendly_env  # pylint: disable=g-import-not-at-top

  cpu_friendly_env()

from absl import app  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/tiny_math.py", "Path to a config file (configs/*.py).", lock_config=True
)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jax_dora.command import run_config_command  # pylint: disable=g-import-not-at-top
  from jax_dora.runtime import run_training  # pylint: disable=g-import-not-at-top
  from jax_dora.summary import finish_run  # pylint: disable=g-import-not-at-top

  summary = run_config_command(_CONFIG.value, run_training)
  if summary.get("role") != "learner-follower":
    print(finish_run(summary), flush=True)
  if summary["integrity_violations"]:
    sys.exit(3)


def run() -> None:
  from jax_dora.runtime import cpu_friendly_env  # pylint: disable=g-import-not-at-top

  cpu_friendly_env()
  app.run(main)


if __name__ == "__main__":
  run()
