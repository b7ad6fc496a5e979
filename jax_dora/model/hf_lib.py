"""``transformers``, imported without TensorFlow.

We use transformers for configs and tokenizers only (weights come from
safetensors). Left alone, ``import transformers`` imports TensorFlow whenever
it is installed (it is, through JetStream's seqio dependency): 8.1 s and
1.09 GB for ``from transformers import AutoTokenizer`` on the 2-core CI
machine, against 2.4 s and 0.26 GB with transformers' own ``USE_TF=0``
switch. A user who sets ``USE_TF`` keeps their choice.
"""

from __future__ import annotations

import os
import types


def import_transformers() -> types.ModuleType:
  """The ``transformers`` module, TensorFlow off unless ``USE_TF`` says otherwise."""
  os.environ.setdefault("USE_TF", "0")
  import transformers  # pylint: disable=g-import-not-at-top

  return transformers
