"""List-valued config fields written as comma-separated strings.

A leaf module (no project imports) so that the config, the data pipeline and
the reward scorer can all parse such fields without importing each other:
``split_csv`` used to live in ``config.py``, which made ``data/pipeline.py``
and ``rewards/scorer.py`` import the config module that imports them.
"""

from __future__ import annotations

from typing import Any


def split_csv(value: Any, cast: type = str) -> list[Any]:
  """``"a, b,,c"`` -> ``[cast("a"), cast("b"), cast("c")]``; a list passes through cast.

  Comma-separated strings are how list-valued fields (task names, reward
  functions and weights, file lists) travel through ``--config.x=y``.
  """
  if isinstance(value, str):
    return [cast(v.strip()) for v in value.split(",") if v.strip()]
  return [cast(v) for v in value]
