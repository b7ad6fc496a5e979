"""The rollout contract is JetStream's API, and importing it costs no TensorFlow.

``jax_dora.jetstream_api`` registers JetStream's ``token_utils`` (the module
that drags in seqio and TensorFlow) as a lazy module. These tests run in
fresh interpreters, since the test process itself may have imported anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jax_dora.jetstream_api import engine_api, tokenizer_api
from jax_dora.model import CharTokenizer
from jax_dora.model.hf_tokenizer import HFTokenizer
from jax_dora.model.tokenizer import PolicyTokenizer
from jax_dora.rollout.engine import DoraEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Imports the rollout engine, builds a tiny engine, prefills and decodes one
# step, then reports what got imported and the peak RSS.
_PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import jax_dora.rollout.engine as E
import_s = time.perf_counter() - t0
# Peak RSS of this image: VmHWM (ru_maxrss survives exec on Linux, so it
# would report the forking pytest process's size).
import_rss_mb = int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) / 1024
import numpy as np
from jax_dora.model import CharTokenizer, ModelConfig, init_params
import jax
cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, max_seq_len=32)
eng = E.DoraEngine(cfg, CharTokenizer(), num_slots=2, max_prefill_length=8)
params = eng.place_params(init_params(cfg, jax.random.PRNGKey(0)))
state = eng.init_decode_state()
state, tok, lp = eng.prefill_insert(params, 0, np.array([1, 5, 6], np.int32), 3, state, 0)
state, res = eng.generate(E.MultiVersionParams.single(0, params), state)
np.asarray(res.data)
# torch's import (the HF parity path) runs inspect.getmodule, which probes
# every module in sys.modules: the deferred one must stay deferred.
import inspect, torch
inspect.getmodule(inspect.currentframe())
print(json.dumps({
    "import_s": import_s,
    "import_rss_mb": import_rss_mb,
    "heavy": sorted(m for m in ("tensorflow", "tensorflow_text", "seqio") if m in sys.modules),
}))
"""


def _run(code: str, timeout: float = 120) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one device: what a rollout server process sees
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_import_and_first_step_load_no_tensorflow():
  """Issue 23's limits: at most 400 MB peak RSS after the import (it was
  1.06 GB with TensorFlow), and no TensorFlow even after a decode step and
  torch's import. The import time is printed, not asserted
  (benchmarks/accelerator.py reports it)."""
  got = _run(_PROBE)
  print(f"import jax_dora.rollout.engine: {got['import_s']:.2f} s, "
        f"peak RSS {got['import_rss_mb']:.0f} MB")
  assert got["heavy"] == []
  assert got["import_rss_mb"] <= 400, got


def test_lazy_token_utils_still_loads_on_use():
  """The real JetStream module is only deferred, not replaced: reading one of
  its attributes runs it (here with seqio installed, so TensorFlow loads)."""
  got = _run(
      "import json, sys\n"
      "from jax_dora.jetstream_api import engine_api\n"
      "from jetstream.engine import token_utils\n"
      "before = 'seqio' in sys.modules\n"
      "cls = token_utils.SentencePieceTokenizer\n"
      "print(json.dumps({'before': before, 'after': 'seqio' in sys.modules,\n"
      "                  'same': engine_api.token_utils.SentencePieceTokenizer is\n"
      "                          sys.modules['jetstream.engine.token_utils'].SentencePieceTokenizer,\n"
      "                  'name': cls.__name__}))\n",
      timeout=300)
  assert got == {"before": False, "after": True, "same": True, "name": "SentencePieceTokenizer"}


@pytest.mark.parametrize("cls, base", [
    (DoraEngine, engine_api.Engine),
    (CharTokenizer, tokenizer_api.Tokenizer),
    (HFTokenizer, tokenizer_api.Tokenizer),
])
def test_classes_implement_every_jetstream_abstract_method(cls, base):
  assert issubclass(cls, base)
  assert base.__abstractmethods__, "JetStream's class lost its abstract methods"
  missing = sorted(m for m in base.__abstractmethods__ if m in cls.__abstractmethods__)
  assert not missing and not cls.__abstractmethods__, missing
  assert issubclass(HFTokenizer, PolicyTokenizer)


def test_transformers_for_configs_and_tokenizers_loads_no_tensorflow():
  """``import transformers`` loads TensorFlow whenever it is installed (8 s,
  1.1 GB here); our HF paths import it through ``hf_lib`` with ``USE_TF=0``."""
  got = _run(
      "import json, os, sys\n"
      "os.environ.pop('USE_TF', None)\n"
      "import jax_dora.rollout.engine\n"
      "from jax_dora.model.hf_lib import import_transformers\n"
      "t = import_transformers()\n"
      "t.AutoTokenizer, t.AutoConfig\n"
      "print(json.dumps({'tf': 'tensorflow' in sys.modules}))\n", timeout=300)
  assert got == {"tf": False}
