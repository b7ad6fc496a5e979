"""The run configuration: typed blocks, the ``ConfigDict`` generated from them, cross-block checks.

Every field a user may override with ``--config.x=y`` is declared in a typed
block (``jax_dora.config.<block>``: one frozen dataclass per block that owns
its defaults, types, docs and range checks); :func:`base_config` is generated
from them, so ml_collections rejects unknown keys at parse time (``KeyError``
naming the key) instead of a typo silently falling back to a default.
``configs/*.py`` start from :func:`base_config` and change only what differs.
:func:`validate` turns a ``ConfigDict`` into the typed :class:`RunConfig`
(each block checks itself) and adds the checks that span blocks; components
take their typed block.
"""

from __future__ import annotations

import ml_collections

from jax_dora.config.audit import AuditConfig
from jax_dora.config.block import ConfigBlock, ConfigError
from jax_dora.config.checkpoint import CheckpointConfig, SnapshotsConfig
from jax_dora.config.data import DataConfig
from jax_dora.config.distributed import DistributedConfig
from jax_dora.config.evaluation import EvalConfig
from jax_dora.config.learner import LearnerConfig
from jax_dora.config.metrics import MetricsConfig
from jax_dora.config.model import RUN_LEVEL_FIELDS, ModelBlock
from jax_dora.config.orchestrator import OrchestratorConfig
from jax_dora.config.pace import PaceConfig
from jax_dora.config.reward import RewardConfig
from jax_dora.config.rollout import LENGTH_MODES, RolloutConfig
from jax_dora.config.run import RunConfig
from jax_dora.config.sft import SftConfig
from jax_dora.config.tools import ToolsConfig
from jax_dora.csv_fields import split_csv
from jax_dora.orchestrator.modes import MODES as _MODE_STRATEGIES

# Names of the training modes (jax_dora.orchestrator.modes owns them).
MODES = tuple(_MODE_STRATEGIES)

__all__ = [
    "AuditConfig", "CheckpointConfig", "ConfigBlock", "ConfigError", "DataConfig", "DistributedConfig",
    "EvalConfig", "LENGTH_MODES", "LearnerConfig", "MODES", "MetricsConfig", "ModelBlock",
    "OrchestratorConfig", "PaceConfig", "RewardConfig", "RolloutConfig", "RunConfig",
    "SftConfig", "SnapshotsConfig", "ToolsConfig", "base_config", "hf_model_config", "recipe_beside", "validate",
]


def base_config() -> ml_collections.ConfigDict:
  """Returns the full default configuration (small enough for a CPU)."""
  return RunConfig().to_config_dict()


def hf_model_config(hf_path: str = "", **run_fields) -> ml_collections.ConfigDict:
  """A ``model`` block for a Hugging Face checkpoint: architecture from its config.json.

  Every architecture field is an unset placeholder; setting one on the
  command line is allowed only if it agrees with the checkpoint (a mismatch
  is an error, never a silent reshape). ``run_fields`` sets ``max_seq_len``,
  ``param_dtype`` and ``dtype``.
  """
  from ml_collections import config_dict  # pylint: disable=g-import-not-at-top

  run_level = ("hf_path", *RUN_LEVEL_FIELDS)
  block = ml_collections.ConfigDict({
      k: v if k in run_level else config_dict.placeholder(type(v))
      for k, v in base_config().model.items()
  })
  block.hf_path = hf_path
  block.update(run_fields)
  return block


def recipe_beside(config_file: str, name: str) -> ml_collections.ConfigDict:
  """``get_config()`` of the recipe ``name``.py in ``config_file``'s directory.

  For a recipe that is another one with a few changes (the TIR and Gemma GSM8K
  recipes start from the Qwen GSM8K one): config files are loaded by path
  (``--config=configs/x.py``), so their directory is not importable.
  """
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(config_file).with_name(f"{name}.py")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def validate(c: ml_collections.ConfigDict | RunConfig) -> RunConfig:
  """The typed config of ``c``; raises :class:`ConfigError` with an actionable message.

  Each block checks its own fields when it is built; what is checked here
  spans blocks.
  """
  run = RunConfig.of(c)
  m, r, d, lc = run.model, run.rollout, run.data, run.learner
  if run.role == "learner" and not r.remote:
    raise ConfigError("config.role=learner needs config.rollout.server_addresses (host:port of the"
                      " rollout servers); role=all runs embedded servers instead")
  if run.role == "all" and r.remote:
    raise ConfigError("config.rollout.server_addresses is set but config.role=all runs embedded"
                      " rollout servers; set config.role=learner to use the remote servers")
  if not r.temperature > 0:
    raise ConfigError(f"config.rollout.temperature={r.temperature} must be > 0: the learner"
                      " scores trajectories under logits / temperature (greedy decoding is not a"
                      " sampling policy GRPO can train on)")
  need = r.max_prefill_length + r.max_new_tokens
  if need > m.max_seq_len:
    raise ConfigError(
        f"rollout.max_prefill_length + rollout.max_new_tokens = {need} exceeds"
        f" model.max_seq_len = {m.max_seq_len}"
    )
  synthetic = not d.uses_files
  if synthetic and d.max_answer_len + 1 > r.max_new_tokens:
    raise ConfigError(
        f"data.max_answer_len={d.max_answer_len} needs rollout.max_new_tokens >="
        f" {d.max_answer_len + 1} (answer + EOS)"
    )
  if synthetic and d.max_prompt_len + 1 > r.max_prefill_length:
    raise ConfigError(
        f"data.max_prompt_len={d.max_prompt_len} needs rollout.max_prefill_length >="
        f" {d.max_prompt_len + 1} (prompt + BOS)"
    )
  if d.prompt_template == "chat" and not m.hf_path:
    raise ConfigError("config.data.prompt_template=chat needs model.hf_path (a tokenizer with a"
                      " chat template); the native character model takes raw prompts")
  if not m.hf_path and m.unset_fields():
    raise ConfigError(f"config.model.{m.unset_fields()[0]} is unset: set model.hf_path to take the"
                      " architecture from a Hugging Face checkpoint, or set the field")
  if not synthetic and "task" in run.reward.names:
    raise ConfigError("config.reward.functions includes 'task', which scores the synthetic tasks;"
                      " dataset files need a reward such as math_verify")
  try:
    from jax_dora.learner.batching import parse_buckets  # pylint: disable=g-import-not-at-top

    parse_buckets(lc.seq_len_buckets, m.max_seq_len)
  except ValueError as e:
    raise ConfigError(f"config.learner.seq_len_buckets={lc.seq_len_buckets!r}: {e}") from e
  if lc.mask_truncated and r.length_mode == "answer":
    raise ConfigError("config.learner.mask_truncated would mask every completion with"
                      " rollout.length_mode=answer (each stops at its length budget)")
  if run.reward.overlong_buffer >= r.max_new_tokens:
    raise ConfigError(f"config.reward.overlong_buffer={run.reward.overlong_buffer} must be in"
                      f" [0, rollout.max_new_tokens={r.max_new_tokens}) and"
                      " overlong_penalty >= 0")
  return run
