"""The typed config blocks: one source of defaults, types, docs and checks.

``base_config()`` is generated from the blocks, so these tests pin what the
generation must preserve (every block's defaults are the ``ConfigDict``'s,
the dataclasses that mirror a block agree with it), that a block refuses what
it does not know, and that no component reads the config around its block
(``int(cfg.x)`` casts and ``cfg.x.get(key, default)`` fallbacks: the
defaults and types live in the blocks and nowhere else).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re

import pytest

from jax_dora.config import (
  ConfigError,
  LearnerConfig,
  ModelBlock,
  PaceConfig,
  RunConfig,
  base_config,
  validate,
)
from jax_dora.learner.losses.settings import LossSettings
from jax_dora.model.config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


BLOCKS = [f.name for f in dataclasses.fields(RunConfig)
          if dataclasses.is_dataclass(getattr(RunConfig(), f.name))]


def test_the_blocks_are_the_ones_users_override():
  assert sorted(BLOCKS) == ["audit", "checkpoint", "data", "distributed", "eval", "learner", "metrics",
                            "model", "orchestrator", "pace", "reward", "rollout", "sft", "snapshots", "tools"]


@pytest.mark.parametrize("name", BLOCKS)
def test_every_block_default_equals_base_config(name):
  block_cls = type(getattr(RunConfig(), name))
  assert block_cls().to_dict() == base_config()[name].to_dict()
  assert block_cls.BLOCK == name


def test_top_level_defaults_equal_base_config():
  c = base_config()
  for f in dataclasses.fields(RunConfig):
    value = getattr(RunConfig(), f.name)
    if not dataclasses.is_dataclass(value):
      assert c[f.name] == value and type(c[f.name]) is type(value), f.name


def test_mirrors_of_a_block_share_its_defaults():
  """ModelConfig (the architecture) and LossSettings (the loss) used to keep their
  own defaults and disagree with the config (max_seq_len 128 vs 96, clip_eps_high
  0.2 vs 0.28)."""
  block = ModelBlock()
  arch = block.architecture  # the block's values as ModelConfig takes them (csv -> tuple)
  for f in dataclasses.fields(ModelConfig):
    if f.name != "vocab_size":
      assert f.default == arch[f.name], f.name
  learner = LearnerConfig()
  same = {"loss": "loss", "aggregation": "loss_aggregation", "correction": "is_correction",
          "correction_level": "is_level", "clip_eps": "clip_eps", "clip_eps_high": "clip_eps_high",
          "gspo_clip_eps": "gspo_clip_eps", "gspo_clip_eps_high": "gspo_clip_eps_high",
          "cispo_clip_high": "cispo_clip_high", "tis_cap": "tis_cap", "mis_low": "mis_low",
          "mis_high": "mis_high", "kl_coef": "kl_coef", "proximal": "proximal_logprobs"}
  defaults = LossSettings()
  for mine, theirs in same.items():
    assert getattr(defaults, mine) == getattr(learner, theirs), mine
  assert LossSettings.from_config(learner, default_norm_length=96) == dataclasses.replace(
      defaults, norm_length=96)


def test_blocks_refuse_unknown_keys_and_wrong_types():
  with pytest.raises(ConfigError, match=r"config.learner: unknown key\(s\) \['learning_rat'\]"):
    LearnerConfig.of({"learning_rat": 0.1})
  with pytest.raises(ConfigError, match=r"config: unknown key\(s\) \['mdoe'\]"):
    RunConfig.of({"mdoe": "dora"})
  with pytest.raises(ConfigError, match="config.pace.target_pool_groups='4' must be a int"):
    PaceConfig.of({"target_pool_groups": "4"})
  # A config.json written by JSON keeps 1 for 1.0: read back as the float it was.
  lc = LearnerConfig.of({"learning_rate": 1})
  assert lc.learning_rate == 1.0 and isinstance(lc.learning_rate, float)
  # Fields an older run's config.json lacks keep their defaults.
  assert PaceConfig.of({}) == PaceConfig()


def test_a_run_config_round_trips_through_json():
  run = validate(base_config())
  again = RunConfig.of(json.loads(json.dumps(run.to_dict())))
  assert again == run


def test_every_field_has_a_doc_line():
  docs = RunConfig.docs()
  assert len(docs) == sum(1 for _ in _leaves(base_config()))
  assert [k for k, v in docs.items() if not v] == []


def _leaves(cfg, prefix=""):
  for k in cfg.keys():
    if hasattr(cfg[k], "keys"):
      yield from _leaves(cfg[k], f"{prefix}{k}.")
    else:
      yield prefix + k


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.stem)
def test_every_shipped_config_is_typed_and_valid(path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  if cfg.role == "learner" and not cfg.rollout.server_addresses:
    cfg.rollout.server_addresses = "localhost:9000"  # pod recipes fill it at launch
  if cfg.model.hf_path:
    # HF recipes name a checkpoint directory; typed without it (validate's
    # cross-block checks need the checkpoint's architecture).
    assert isinstance(RunConfig.of(cfg), RunConfig)
  else:
    assert isinstance(validate(cfg), RunConfig)


# A component reading the run config around its typed block: a cast
# (int(cfg.learner.x)) or a fallback default (cfg.learner.get("x", 0)).
_CAST = re.compile(r"\b(int|float|bool|str)\(\s*(self\.)?(cfg|config|run_cfg|learner_cfg|"
                   r"model_cfg|settings)\.[a-z_]")
_FALLBACK = re.compile(r"\b(self\.)?(cfg|config|run_cfg|learner_cfg|settings)(\.[a-z_]+)*\.get\(")


def test_no_component_casts_or_defaults_config_values():
  offenders = []
  for path in sorted((ROOT / "jax_dora").rglob("*.py")):
    if "config" in path.relative_to(ROOT / "jax_dora").parts[:1]:
      continue  # the blocks themselves
    for n, line in enumerate(path.read_text().splitlines(), 1):
      if _CAST.search(line) or _FALLBACK.search(line):
        offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
  assert offenders == []
