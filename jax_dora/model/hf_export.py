"""Write a policy back as a Hugging Face model directory that ``transformers`` loads.

The exported directory holds ``config.json``, safetensors shards (plus their
index when there is more than one), ``generation_config.json`` and the
tokenizer files. A policy imported from a checkpoint keeps that checkpoint's
``config.json`` (only the dtype is updated) and tensor names, so import ->
export is bit-exact in the source dtype; a native model is written as the
family its config matches (``families.family_for``).

The directory is written under a temporary name and renamed into place at
the end, so an interrupted export never leaves something that looks complete.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import tempfile
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jax_dora.model.config import ModelConfig
from jax_dora.model.families import Family, family_for, get_family
from jax_dora.model.hf_checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, _read_json, _tree_get

_log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _host(x: Any) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _shard_names(n: int) -> list[str]:
  if n == 1:
    return [SINGLE_FILE]
  return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def export_hf(
    params: Any,
    cfg: ModelConfig,
    out_dir: str,
    *,
    source_dir: str | None = None,
    tokenizer_dir: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 4 * 2**30,
    overwrite: bool = False,
) -> str:
  """Writes ``params`` (our layout) as an HF checkpoint in ``out_dir``.

  Args:
    params: Param pytree of ``cfg`` (device arrays or numpy).
    cfg: Its model config.
    out_dir: Destination directory (created; must not exist unless
      ``overwrite``).
    source_dir: The HF checkpoint the policy was imported from, if any: its
      ``config.json`` and ``generation_config.json`` are reused.
    tokenizer_dir: Where to copy tokenizer files from (default
      ``source_dir``).
    dtype: Storage dtype (``float32``/``bfloat16``/``float16``); default the
      source checkpoint's, else ``cfg.param_dtype``.
    max_shard_bytes: Shard size limit.
    overwrite: Replace an existing ``out_dir``.

  Returns:
    ``out_dir``.
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and not overwrite:
    raise FileExistsError(f"{out_dir} exists (pass overwrite to replace it)")
  source_cfg = _read_json(os.path.join(source_dir, CONFIG_FILE)) if source_dir else None
  family: Family = get_family(source_cfg["model_type"]) if source_cfg else family_for(cfg)
  if dtype is None:
    dtype = (source_cfg or {}).get("dtype") or (source_cfg or {}).get("torch_dtype") or cfg.param_dtype
  if dtype not in _NP_DTYPES:
    raise ValueError(f"export dtype {dtype!r} is not one of {sorted(_NP_DTYPES)}")
  np_dtype = _NP_DTYPES[dtype]

  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
  try:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    maps = family.tensors(cfg)
    # Expert tensors are slices of one stacked param: fetch it to host once.
    pending = collections.Counter(m.path for m in maps if m.index is not None)
    stacked: dict[tuple[str, ...], np.ndarray] = {}
    for m in maps:
      if m.index is None:
        hf = m.layout.to_hf(_host(_tree_get(params, m.path))).astype(np_dtype)
      else:
        if m.path not in stacked:
          stacked[m.path] = _host(_tree_get(params, m.path))
        hf = m.layout.to_hf(stacked[m.path][m.index]).astype(np_dtype)
        pending[m.path] -= 1
        if not pending[m.path]:
          del stacked[m.path]
      if size and size + hf.nbytes > max_shard_bytes:
        shards.append({})
        size = 0
      shards[-1][m.hf_name] = hf
      size += hf.nbytes
    names = _shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for name, tensors in zip(names, shards):
      save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
      weight_map.update({t: name for t in tensors})
      total += sum(a.nbytes for a in tensors.values())
    if len(names) > 1:
      with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    _write_config(tmp, cfg, family, source_cfg, dtype)
    copies = [(source_dir, "generation_config.json")] + [
        (tokenizer_dir or source_dir, f) for f in TOKENIZER_FILES]
    for src, fname in copies:
      if src and os.path.exists(os.path.join(src, fname)):
        shutil.copy2(os.path.join(src, fname), os.path.join(tmp, fname))
    if os.path.exists(out_dir):
      shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  _log.info("exported %s (%s, %d shard(s)) to %s", family.name, dtype, len(names), out_dir)
  return out_dir


def _write_config(out: str, cfg: ModelConfig, family: Family, source_cfg: dict[str, Any] | None,
                  dtype: str) -> None:
  if source_cfg is not None:
    conf = dict(source_cfg)
    conf["torch_dtype" if "torch_dtype" in conf else "dtype"] = dtype
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
      json.dump(conf, f, indent=2, sort_keys=True)
    return
  from jax_dora.model.hf_lib import import_transformers  # pylint: disable=g-import-not-at-top

  transformers = import_transformers()

  hf = transformers.AutoConfig.for_model(
      family.name, architectures=[family.architectures[0]], **family.to_hf(cfg))
  setattr(hf, "dtype" if hasattr(hf, "dtype") else "torch_dtype", dtype)
  hf.save_pretrained(out)
