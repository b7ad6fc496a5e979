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
    """From the run config's ``learner`` block (``jax_dora.config`` holds the defaults)."""
    return cls(
        loss=str(cfg.loss),
        aggregation=str(cfg.loss_aggregation),
        correction=str(cfg.is_correction),
        correction_level=str(cfg.is_level),
        clip_eps=float(cfg.clip_eps),
        clip_eps_high=float(cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high),
        gspo_clip_eps=float(cfg.gspo_clip_eps),
        gspo_clip_eps_high=float(cfg.gspo_clip_eps_high),
        cispo_clip_high=float(cfg.cispo_clip_high),
        tis_cap=float(cfg.tis_cap),
        mis_low=float(cfg.mis_low),
        mis_high=float(cfg.mis_high),
        kl_coef=float(cfg.kl_coef),
        norm_length=int(cfg.loss_norm_length or default_norm_length),
        proximal=str(cfg.proximal_logprobs),
    )

  @property
  def needs_proximal(self) -> bool:
    """Whether the loss reads pi_prox (otherwise it only feeds the metrics)."""
    return self.loss == "decoupled_ppo" or self.correction != "none"
