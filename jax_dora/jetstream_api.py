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
*deferred* module: the name resolves to a stand-in that runs the real module
body -- with seqio and TensorFlow -- the first time one of its public
attributes is read, and forwards to it from then on. Dunder probes
(``__file__``, ``__spec__``, ...) do not load it: ``inspect.getmodule`` reads
``__file__`` of every module in ``sys.modules`` (torch does so at import),
which is why the standard library's ``LazyLoader`` is not used here.
Nothing of JetStream is copied or patched: the real module loads on first
use, and the same import works where seqio is not installed at all (an
accelerator host given JetStream's wheel with ``--no-deps``).
``tests/test_import_cost.py`` checks that TensorFlow stays out of
``sys.modules`` (with torch imported too) and that our classes implement
every abstract method of JetStream's.

Import ``engine_api`` / ``tokenizer_api`` / ``tokenizer_pb2`` from here, never
from ``jetstream.engine`` directly (a direct import first would load
``token_utils`` eagerly).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

# Modules JetStream imports eagerly but we never use; loaded only on first
# use of a public attribute.
LAZY_MODULES = ("jetstream.engine.token_utils",)


class _DeferredModule(types.ModuleType):
  """Stands in for a module until one of its public attributes is read."""

  def __init__(self, spec: importlib.machinery.ModuleSpec):
    super().__init__(spec.name)
    self.__spec__ = spec
    self.__loader__ = spec.loader
    self.__file__ = spec.origin
    self.__package__ = spec.parent
    self._deferred_real: types.ModuleType | None = None

  def __getattr__(self, attr: str):  # only for names not set above
    if attr.startswith("__") and attr.endswith("__"):
      raise AttributeError(attr)  # a probe, not a use: stay deferred
    if self._deferred_real is None:
      spec = self.__spec__
      real = importlib.util.module_from_spec(spec)
      sys.modules[spec.name] = real
      try:
        spec.loader.exec_module(real)
      except BaseException:
        sys.modules[spec.name] = self
        raise
      parent, _, child = spec.name.rpartition(".")
      setattr(sys.modules[parent], child, real)
      self._deferred_real = real
    return getattr(self._deferred_real, attr)


def _register_lazy(name: str) -> types.ModuleType:
  """Puts a deferred stand-in for module ``name`` into ``sys.modules`` (once)."""
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.find_spec(name)  # imports the parent packages (jax only)
  if spec is None or spec.loader is None:
    raise ImportError(f"{name} not found: is google-jetstream installed?")
  module = _DeferredModule(spec)
  sys.modules[name] = module
  parent, _, child = name.rpartition(".")
  setattr(sys.modules[parent], child, module)
  return module


for _name in LAZY_MODULES:
  _register_lazy(_name)

# pylint: disable=g-import-not-at-top,wrong-import-position
from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2

__all__ = ["LAZY_MODULES", "engine_api", "tokenizer_api", "tokenizer_pb2"]
