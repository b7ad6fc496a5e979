"""JetStream's ``Engine`` / ``Tokenizer`` API, imported without TensorFlow.

JetStream's ``Engine`` and ``Tokenizer`` abstract classes are the rollout
contract (``DoraEngine`` and ``PolicyTokenizer`` subclass them). But
``jetstream.engine.engine_api`` imports ``token_utils`` at module level, and
``token_utils`` imports ``seqio.vocabularies``, which imports TensorFlow and
tensorflow_text: about 12 s and 800 MB in every rollout server, test
subprocess and main job (measured on the 2-core CI machine: 6.4 s / 1.06 GB
for ``import jax_dora.rollout.engine`` against 1.4 s / 0.21 GB for jax and
flax alone), and on an accelerator host a second framework probing the
devices. ``engine_api`` reads ``token_utils`` in one place only,
``Engine.build_tokenizer``'s default (a SentencePiece tokenizer), which our
engine overrides.

So before ``engine_api`` is imported, ``token_utils`` is registered as a
*lazy* module (the standard library's ``importlib.util.LazyLoader``): the
name resolves, and the module body -- with seqio and TensorFlow -- runs only
if one of its attributes is ever read. Nothing of JetStream is copied or
patched: the real module loads on first use, and the same import works where
seqio is not installed at all (an accelerator host given JetStream's wheel
with ``--no-deps``). ``tests/test_import_cost.py`` checks that TensorFlow
stays out of ``sys.modules`` and that our classes implement every abstract
method of JetStream's.

Import ``engine_api`` / ``tokenizer_api`` / ``tokenizer_pb2`` from here, never
from ``jetstream.engine`` directly (a direct import first would load
``token_utils`` eagerly).
"""

from __future__ import annotations

import importlib.util
import sys
import types

# Modules JetStream imports eagerly but we never use; loaded only on first
# attribute access.
LAZY_MODULES = ("jetstream.engine.token_utils",)


def _register_lazy(name: str) -> types.ModuleType:
  """Puts a lazily executed module ``name`` into ``sys.modules`` (once)."""
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.find_spec(name)  # imports the parent packages (jax only)
  if spec is None or spec.loader is None:
    raise ImportError(f"{name} not found: is google-jetstream installed?")
  loader = importlib.util.LazyLoader(spec.loader)
  spec.loader = loader
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  loader.exec_module(module)  # lazy: only arms the loader
  parent, _, child = name.rpartition(".")
  setattr(sys.modules[parent], child, module)
  return module


for _name in LAZY_MODULES:
  _register_lazy(_name)

# pylint: disable=g-import-not-at-top,wrong-import-position
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2

__all__ = ["LAZY_MODULES", "engine_api", "tokenizer_api", "tokenizer_pb2"]
