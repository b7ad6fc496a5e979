"""The loss hyper-parameters, read once from the ``learner`` config block."""

from __future__ import annotations

import dataclasses
import math

import ml_collections


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """Everything the objective, correction and aggregation read.

  Frozen and hashable: it is closed over by the jitted train step, so it must
  be static.
  """

  loss: str = "grpo"
  aggregation: str = "token_mean"
  correction: str = "none"
  correction_level: str = "token"  # token | sequence (geometric mean over the sequence)
  clip_eps: float = 0.2
  clip_eps_high: float = 0.2
  gspo_clip_eps: float = 3e-4
  gspo_clip_eps_high: float = 4e-4
  cispo_clip_high: float = 5.0
  tis_cap: float = math.inf
  mis_low: float = 0.0
  mis_high: float = math.inf
  kl_coef: float = 0.0
  norm_length: int = 1  # Dr.GRPO's constant (seq_mean_token_sum_norm)
  proximal: str = "recompute"  # recompute | loglinear

  @classmethod
  def from_config(cls, cfg: ml_collections.ConfigDict, default_norm_length: int) -> LossSettings:
    get = cfg.get
    return cls(
        loss=str(get("loss", "grpo")),
        aggregation=str(get("loss_aggregation", "token_mean")),
        correction=str(get("is_correction", "none")),
        correction_level=str(get("is_level", "token")),
        clip_eps=float(get("clip_eps", 0.2)),
        clip_eps_high=float(get("clip_eps_high", None) or get("clip_eps", 0.2)),
        gspo_clip_eps=float(get("gspo_clip_eps", 3e-4)),
        gspo_clip_eps_high=float(get("gspo_clip_eps_high", 4e-4)),
        cispo_clip_high=float(get("cispo_clip_high", 5.0)),
        tis_cap=float(get("tis_cap", math.inf)),
        mis_low=float(get("mis_low", 0.0)),
        mis_high=float(get("mis_high", math.inf)),
        kl_coef=float(get("kl_coef", 0.0)),
        norm_length=int(get("loss_norm_length", 0) or default_norm_length),
        proximal=str(get("proximal_logprobs", "recompute")),
    )

  @property
  def needs_proximal(self) -> bool:
    """Whether the loss reads pi_prox (otherwise it only feeds the metrics)."""
    return self.loss == "decoupled_ppo" or self.correction != "none"
