"""Import a local Hugging Face model directory onto device shardings.

``open_checkpoint(DIR)`` reads ``config.json`` (architecture -> family ->
``ModelConfig``) and the safetensors layout (one ``model.safetensors`` or the
shards named by ``model.safetensors.index.json``) and validates all of it
before a byte of weights is read: unknown architectures, missing or truncated
shards, missing or unexpected tensors and shapes that disagree with
``config.json`` are errors naming the file and tensor, never a silent reshape.

``load_params`` then walks the shards one file at a time and builds every
parameter with ``jax.make_array_from_callback`` on its target sharding: each
device's slice is read straight from the memory-mapped shard (only the rows
it needs), converted to ``param_dtype`` and placed. No full copy of the model,
or even of one tensor, is assembled on the host, and on a multi-host mesh
each process reads only its own devices' slices.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
from typing import Any

import jax
import numpy as np

# ModelConfig fields that come from the run, never from config.json.
from jax_dora.config.model import RUN_LEVEL_FIELDS
from jax_dora.model.config import ModelConfig
from jax_dora.model.families import Family, TensorMap, get_family
from jax_dora.model.families.base import UnsupportedCheckpointError, stacked_shapes

_log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
  """A Hugging Face checkpoint is missing, corrupt or inconsistent."""


@dataclasses.dataclass
class HFCheckpoint:
  """A validated HF model directory (nothing of the weights read yet)."""

  path: str
  family: Family
  hf_config: Any  # transformers.PretrainedConfig
  raw_config: dict[str, Any]
  weight_map: dict[str, str]  # tensor name -> shard file name

  @property
  def torch_dtype(self) -> str | None:
    """Storage dtype named in config.json (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    d = self.raw_config.get("dtype") or self.raw_config.get("torch_dtype")
    return str(d) if d else None

  def shard_path(self, file: str) -> str:
    return os.path.join(self.path, file)


def _read_json(file: str) -> dict[str, Any]:
  try:
    with open(file) as f:
      out = json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{file} does not exist") from None
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{file} is not valid JSON: {e}") from e
  if not isinstance(out, dict):
    raise CheckpointError(f"{file} does not hold a JSON object")
  return out


def _safetensors_keys(file: str) -> list[str]:
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  try:
    with safe_open(file, "numpy") as f:
      return list(f.keys())
  except FileNotFoundError:
    raise CheckpointError(f"shard {file} is missing") from None
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise CheckpointError(f"shard {file} is corrupt or truncated: {e}") from e


def open_checkpoint(path: str) -> HFCheckpoint:
  """Validates ``path`` as a safetensors HF checkpoint of a supported family.

  Raises:
    CheckpointError: missing ``config.json``, no safetensors, an index naming
      a missing shard, a truncated shard, a tensor listed twice.
    UnsupportedCheckpointError: an architecture (or feature) we do not run.
  """
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise CheckpointError(f"model directory {path} does not exist")
  raw = _read_json(os.path.join(path, CONFIG_FILE))
  model_type = raw.get("model_type")
  family = get_family(str(model_type))
  archs = raw.get("architectures") or []
  if archs and not set(archs) & set(family.architectures):
    raise UnsupportedCheckpointError(
        f"{path}/{CONFIG_FILE}: architectures={archs} is not a causal LM of family"
        f" {family.name!r} (supported: {list(family.architectures)})")
  try:
    from jax_dora.model.hf_lib import import_transformers  # pylint: disable=g-import-not-at-top

    transformers = import_transformers()

    hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise CheckpointError(f"{path}/{CONFIG_FILE}: transformers cannot parse it: {e}") from e

  index_file = os.path.join(path, INDEX_FILE)
  weight_map: dict[str, str] = {}
  if os.path.exists(index_file):
    listed = _read_json(index_file).get("weight_map")
    if not isinstance(listed, dict) or not listed:
      raise CheckpointError(f"{index_file} has no weight_map")
    for file in sorted(set(listed.values())):
      keys = set(_safetensors_keys(os.path.join(path, file)))
      names = {n for n, f in listed.items() if f == file}
      absent = sorted(names - keys)
      if absent:
        raise CheckpointError(
            f"shard {os.path.join(path, file)} lacks tensors the index assigns to it: {absent[:5]}")
    weight_map = {str(n): str(f) for n, f in listed.items()}
  elif os.path.exists(os.path.join(path, SINGLE_FILE)):
    weight_map = {n: SINGLE_FILE for n in _safetensors_keys(os.path.join(path, SINGLE_FILE))}
  else:
    others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".gguf")))
    raise CheckpointError(
        f"{path} has no {SINGLE_FILE} or {INDEX_FILE}"
        + (f" (found {others}: convert them to safetensors first)" if others else ""))
  return HFCheckpoint(path, family, hf_config, raw, weight_map)


def model_config_from_checkpoint(
    ckpt: HFCheckpoint, explicit: dict[str, Any] | None = None, **run_fields: Any
) -> ModelConfig:
  """``ModelConfig`` of ``ckpt``; ``explicit`` architecture values must agree with it.

  Args:
    ckpt: An opened checkpoint.
    explicit: Architecture fields the run config sets (non-``None``); each
      must equal what ``config.json`` says, or this raises naming both: a
      mismatch would otherwise mean a silently wrong load or reshape.
    **run_fields: ``max_seq_len``, ``param_dtype``, ``dtype`` (run-level).
  """
  arch = ckpt.family.from_hf(ckpt.hf_config)
  for key, value in (explicit or {}).items():
    if key in RUN_LEVEL_FIELDS or value is None:
      continue
    if key not in ModelConfig.field_names():
      raise CheckpointError(f"unknown model config key model.{key}")
    have = arch.get(key, ModelConfig.__dataclass_fields__[key].default)
    if have != value:
      raise CheckpointError(
          f"model.{key}={value!r} in the run config, but {ckpt.path}/{CONFIG_FILE} gives"
          f" {have!r}: an HF model's architecture comes from its config.json, so drop the"
          " override, or start from a config whose model block is"
          " jax_dora.config.hf_model_config(...) (e.g. configs/qwen2_5_0_5b_gsm8k.py) rather than"
          " the tiny model's")
  unknown_run = set(run_fields) - set(RUN_LEVEL_FIELDS)
  if unknown_run:
    raise ValueError(f"not run-level model fields: {sorted(unknown_run)}")
  return ModelConfig(**arch, **run_fields)


def _tree_set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _tree_get(tree: Any, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _paths(tree: Any) -> list[tuple[str, ...]]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [tuple(str(getattr(k, "key", k)) for k in p) for p, _ in leaves]


def check_tensor_names(ckpt: HFCheckpoint, cfg: ModelConfig) -> list[TensorMap]:
  """The tensor maps for ``cfg``, after checking the checkpoint has exactly those tensors."""
  maps = ckpt.family.tensors(cfg)
  wanted = {m.hf_name for m in maps}
  missing = sorted(wanted - set(ckpt.weight_map))
  if missing:
    raise CheckpointError(
        f"{ckpt.path}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:5]}")
  unexpected = sorted(n for n in set(ckpt.weight_map) - wanted if not ckpt.family.ignored(cfg, n))
  if unexpected:
    raise CheckpointError(
        f"{ckpt.path}: {len(unexpected)} tensor(s) the {ckpt.family.name} layout does not"
        f" have (config.json disagrees with the weights?), e.g. {unexpected[:5]}")
  return maps


def load_params(ckpt: HFCheckpoint, cfg: ModelConfig, shardings: Any) -> dict[str, Any]:
  """Reads every parameter of ``cfg`` from ``ckpt`` directly onto ``shardings``.

  Args:
    ckpt: From :func:`open_checkpoint`.
    cfg: The model config (from :func:`model_config_from_checkpoint`).
    shardings: A pytree of ``jax.sharding.Sharding`` with the structure of
      the model's params (the learner's param shardings or a rollout
      engine's), or a single sharding for every leaf.

  Raises:
    CheckpointError: a tensor whose shape disagrees with ``config.json``, or
      a shard that cannot be read.
  """
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top

  maps = check_tensor_names(ckpt, cfg)
  shapes = stacked_shapes(maps)
  by_path: dict[tuple[str, ...], list[TensorMap]] = collections.defaultdict(list)
  for m in maps:
    by_path[m.path].append(m)
  single = isinstance(shardings, jax.sharding.Sharding)
  if not single:
    ours = set(_paths(shardings))
    if ours != set(by_path):
      raise ValueError(
          f"the {ckpt.family.name} tensor map and the model's params differ:"
          f" {sorted(ours ^ set(by_path))[:5]} (a bug in the family module)")
  dtype = cfg.jnp_param_dtype
  params: dict[str, Any] = {}
  with contextlib.ExitStack() as files:
    handles: dict[str, Any] = {}

    def tensor(m: TensorMap) -> Any:
      """The lazy safetensors slice of ``m``'s tensor, its shape checked."""
      file = ckpt.weight_map[m.hf_name]
      full = ckpt.shard_path(file)
      try:
        if file not in handles:
          handles[file] = files.enter_context(safe_open(full, "numpy"))
        sl = handles[file].get_slice(m.hf_name)
      except Exception as e:  # pylint: disable=broad-exception-caught
        raise CheckpointError(f"shard {full} could not be read: {type(e).__name__}: {e}") from e
      shape = tuple(int(d) for d in sl.get_shape())
      if shape != m.layout.hf_shape:
        raise CheckpointError(
            f"{full}: tensor {m.hf_name} has shape {shape}, but config.json implies"
            f" {m.layout.hf_shape}")
      return sl

    for path in sorted(by_path):
      parts = sorted(by_path[path], key=lambda m: -1 if m.index is None else m.index)
      slices_of = [tensor(m) for m in parts]
      sharding = shardings if single else _tree_get(shardings, path)
      # Devices holding the same slice (replicas over data / slot axes) share one read of it.
      cache: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

      def read_one(m: TensorMap, sl: Any, index: tuple[slice, ...]) -> np.ndarray:
        # Convert while the block is still in the file's (contiguous) layout,
        # and never when the dtype already matches: our transpose and head
        # split then stay numpy views, which device_put hands to PJRT as
        # strided buffers; its transpose runs several times faster than a
        # numpy copy of the view.
        return m.layout.read_slice(lambda i: np.asarray(sl[i]).astype(dtype, copy=False), index)

      def read(index, parts=parts, slices_of=slices_of, cache=cache, shape=shapes[path]):
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if key not in cache:
          try:
            if parts[0].index is None:
              cache[key] = read_one(parts[0], slices_of[0], index)
            else:  # stacked experts: read only this device's experts
              lo, hi = key[0]
              cache[key] = np.stack([read_one(parts[x], slices_of[x], tuple(index[1:]))
                                     for x in range(lo, hi)])
          except CheckpointError:
            raise
          except Exception as e:  # pylint: disable=broad-exception-caught
            raise CheckpointError(f"{ckpt.path}: tensor {parts[0].hf_name} could not be read:"
                                  f" {type(e).__name__}: {e}") from e
        return cache[key]

      if parts[0].index is not None and [m.index for m in parts] != list(range(len(parts))):
        raise ValueError(f"{path}: expert tensors {[m.index for m in parts]} are not 0..n-1"
                         " (a bug in the family module)")
      _tree_set(params, path, jax.make_array_from_callback(shapes[path], sharding, read))
    _log.debug("loaded %d tensors from %s", len(maps), ckpt.path)
  return params
