"""Export a trained policy as a Hugging Face model directory.

Usage::

  python -m jax_dora.export --run_dir=runs/qwen_gsm8k --out=exported/step200 [--step=200]

Reads the run's ``model_config.json`` (written at start-up), takes the params
of policy version ``--step`` (default: the newest) from the run's snapshots,
or from its run checkpoint of that step when the snapshot was already
retired, and writes ``config.json``, safetensors and the tokenizer files of
the checkpoint the run started from (``--tokenizer_dir`` when that directory
has moved). ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads
the result. Runs on the host CPU by default: a 7B policy in float32 does not
fit one accelerator's memory, and exporting needs no accelerator.
"""

from __future__ import annotations

import json
import logging
import os
import sys

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

_RUN_DIR = flags.DEFINE_string("run_dir", None, "Run output_dir (holds model_config.json).")
_OUT = flags.DEFINE_string("out", None, "Directory to write the HF model to.")
_STEP = flags.DEFINE_integer("step", -1, "Policy version / learner step; -1 = newest.")
_DTYPE = flags.DEFINE_string("dtype", "", "Storage dtype; default: the source checkpoint's, else param_dtype.")
_TOKENIZER_DIR = flags.DEFINE_string("tokenizer_dir", "", "Where the tokenizer files are, if not the run's hf_path.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out directory.")

_log = logging.getLogger("jax_dora.export")


class ExportError(RuntimeError):
  """The run directory lacks what an export needs."""


def load_run_params(run_dir: str, step: int | None = None):
  """``(ModelConfig, hf_path, params, step)`` of a run's policy version ``step``.

  Snapshots first (params only); the run checkpoint of ``step`` otherwise, and
  also when the snapshot holds the servers' cast copy (``snapshots.write_dtype``,
  e.g. bfloat16 of float32 master weights) and a checkpoint has the master.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top

  from jax_dora.model import ModelConfig  # pylint: disable=g-import-not-at-top
  from jax_dora.orchestrator.run_checkpoint import RunCheckpointer  # pylint: disable=g-import-not-at-top
  from jax_dora.snapshots import SnapshotReader  # pylint: disable=g-import-not-at-top

  run = epath.Path(run_dir)
  meta_file = run / "model_config.json"
  if not meta_file.exists():
    raise ExportError(f"{meta_file} not found: is {run_dir} a jax-dora run directory?")
  meta = json.loads(meta_file.read_text())
  cfg = ModelConfig(**meta["model"])
  from jax_dora.config import SnapshotsConfig  # pylint: disable=g-import-not-at-top

  snapshots = SnapshotsConfig.of(json.loads((run / "config.json").read_text())["snapshots"])
  snap_dir = snapshots.directory or str(run / "snapshots")
  reader = SnapshotReader(snap_dir)
  versions = reader.versions()
  if step is None or step < 0:
    if not versions:
      raise ExportError(f"no snapshot in {snap_dir}; pass --step of a run checkpoint")
    step = versions[-1]
  params = None
  if step in versions:
    params, _ = reader.load(step)
    master = {str(x.dtype) for x in jax.tree.leaves(params)} == {cfg.param_dtype}
    if master:
      return cfg, meta.get("hf_path"), params, step
  ckpt = RunCheckpointer(run / "checkpoints")
  try:
    steps = ckpt.all_steps()
    if step not in steps and params is not None:
      logging.warning("snapshot %d holds the servers' %s copy and no run checkpoint has step %d:"
                      " exporting the cast copy", step, jax.tree.leaves(params)[0].dtype, step)
      return cfg, meta.get("hf_path"), params, step
    if step not in steps:
      raise ExportError(
          f"step {step} is neither a snapshot ({versions}) nor a run checkpoint ({steps})")
    state = ckpt.restore_unsharded(step)
  finally:
    ckpt.close()
  return cfg, meta.get("hf_path"), state["params"], step


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _RUN_DIR.value or not _OUT.value:
    raise app.UsageError("--run_dir and --out are required")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(name)s: %(message)s")
  from jax_dora.model.hf_export import export_hf  # pylint: disable=g-import-not-at-top

  try:
    cfg, hf_path, params, step = load_run_params(_RUN_DIR.value, _STEP.value)
  except ExportError as e:
    print(f"export error: {e}", file=sys.stderr)
    sys.exit(2)
  tok_dir = _TOKENIZER_DIR.value or hf_path
  if hf_path and not os.path.isdir(hf_path):
    _log.warning("the run's source checkpoint %s is gone: writing config.json from the model config",
                 hf_path)
    hf_path = None
  if not tok_dir or not os.path.isdir(tok_dir):
    _log.warning("no tokenizer files to copy (native character model, or pass --tokenizer_dir)")
    tok_dir = None
  out = export_hf(params, cfg, _OUT.value, source_dir=hf_path, tokenizer_dir=tok_dir,
                  dtype=_DTYPE.value or None, overwrite=_OVERWRITE.value)
  print(f"exported policy version {step} to {out}")


def run() -> None:
  app.run(main)


if __name__ == "__main__":
  run()
