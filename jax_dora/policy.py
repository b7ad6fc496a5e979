"""Which policy a run trains: model config, tokenizer and initial weights.

The one place that reads ``config.model`` (and the prompt settings of
``config.data``) and decides between the tiny native character model and a
Hugging Face checkpoint (``model.hf_path``). The learner, the embedded and
remote rollout servers and the export CLI all resolve the policy here, so
they agree on architecture, vocabulary, stop ids and suppressed ids by
construction.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ml_collections
import numpy as np

from jax_dora.config import DataConfig, ModelBlock, RunConfig
from jax_dora.config.model import RUN_LEVEL_FIELDS
from jax_dora.model import CharTokenizer, ModelConfig, suppress_mask
from jax_dora.model.tokenizer import PolicyTokenizer

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class PolicySpec:
  """A resolved policy.

  Attributes:
    model_cfg: Architecture and numerics.
    tokenizer: Prompt encoding, stop and suppressed ids.
    checkpoint: The opened HF checkpoint (``jax_dora.model.hf_checkpoint``)
      to initialise from, or None for a random native init.
  """

  model_cfg: ModelConfig
  tokenizer: PolicyTokenizer
  checkpoint: Any = None

  @property
  def suppress_mask(self) -> np.ndarray | None:
    """``[vocab]`` ids never sampled (and masked by the learner alike)."""
    v = self.model_cfg.vocab_size
    return suppress_mask(v, self.tokenizer.suppressed_ids(v))

  @property
  def hf_path(self) -> str | None:
    return None if self.checkpoint is None else self.checkpoint.path

  def load_params(self, shardings: Any) -> Any:
    """Initial params read from the checkpoint directly onto ``shardings``."""
    from jax_dora.model.hf_checkpoint import load_params  # pylint: disable=g-import-not-at-top

    if self.checkpoint is None:
      raise ValueError("a native model has no checkpoint to load: it is initialised randomly")
    return load_params(self.checkpoint, self.model_cfg, shardings)


def _architecture_overrides(model: ModelBlock) -> dict[str, Any]:
  """Architecture values the run config sets explicitly (non-None)."""
  return {k: v for k, v in model.architecture.items() if k not in RUN_LEVEL_FIELDS}


def resolve_policy(cfg: RunConfig | ml_collections.ConfigDict) -> PolicySpec:
  """The policy ``cfg`` describes; validates an HF checkpoint without reading its weights.

  Raises:
    jax_dora.model.hf_checkpoint.CheckpointError: a bad checkpoint or an
      architecture value that disagrees with its config.json.
    jax_dora.model.families.UnsupportedCheckpointError: an unknown
      architecture.
    jax_dora.model.hf_tokenizer.TokenizerLoadError: unusable tokenizer files.
  """
  m, d = ModelBlock.of(cfg.model), DataConfig.of(cfg.data)
  if not m.hf_path:
    if d.prompt_template != "raw":
      raise ValueError("data.prompt_template=chat needs a tokenizer with a chat template"
                       " (model.hf_path); the native character model takes raw prompts")
    tokenizer = CharTokenizer()
    return PolicySpec(ModelConfig.from_config_dict(m.architecture, vocab_size=tokenizer.vocab_size),
                      tokenizer)

  from jax_dora.model.hf_checkpoint import (  # pylint: disable=g-import-not-at-top
      model_config_from_checkpoint,
      open_checkpoint,
  )
  from jax_dora.model.hf_tokenizer import HFTokenizer  # pylint: disable=g-import-not-at-top

  ckpt = open_checkpoint(m.hf_path)
  model_cfg = model_config_from_checkpoint(
      ckpt, _architecture_overrides(m),
      max_seq_len=m.max_seq_len, param_dtype=m.param_dtype, dtype=m.dtype,
      attention_impl=m.attention_impl)
  tokenizer = HFTokenizer(ckpt.path, d.prompt_template, d.system_prompt, d.prompt_suffix)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(
        f"{ckpt.path}: the tokenizer has {tokenizer.vocab_size} ids but the model's embedding"
        f" only {model_cfg.vocab_size} rows")
  _log.info("policy: %s from %s (%d layers, d_model %d, vocab %d, %s params, %s activations)",
            ckpt.family.name, ckpt.path, model_cfg.n_layers, model_cfg.d_model,
            model_cfg.vocab_size, model_cfg.param_dtype, model_cfg.dtype)
  return PolicySpec(model_cfg, tokenizer, ckpt)
