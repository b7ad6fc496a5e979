"""The loss hyper-parameters, read once from the ``learner`` config block."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """Everything the objective, correction and aggregation read.

  Frozen and hashable: it is closed over by the jitted train step, so it must
  be static. Its defaults are ``LearnerConfig``'s (a test holds them equal);
  ``norm_length`` is the resolved length, never 0.
  """

  loss: str = "grpo"
  aggregation: str = "token_mean"
  correction: str = "none"
  correction_level: str = "token"  # token | sequence (geometric mean over the sequence)
  clip_eps: float = 0.2
  clip_eps_high: float = 0.28  # = LearnerConfig.clip_eps_high
  gspo_clip_eps: float = 3e-4
  gspo_clip_eps_high: float = 4e-4
  cispo_clip_high: float = 5.0
  tis_cap: float = 2.0
  mis_low: float = 0.5
  mis_high: float = 2.0
  kl_coef: float = 0.0
  norm_length: int = 1  # Dr.GRPO's constant (seq_mean_token_sum_norm)
  proximal: str = "recompute"  # recompute | loglinear

  @classmethod
  def from_config(cls, learner: Any, default_norm_length: int) -> LossSettings:
    """From the typed ``learner`` block (``jax_dora.config.LearnerConfig``, which owns the
    defaults and checks; not imported here, since it checks names against this package)."""
    return cls(
        loss=learner.loss,
        aggregation=learner.loss_aggregation,
        correction=learner.is_correction,
        correction_level=learner.is_level,
        clip_eps=learner.clip_eps,
        clip_eps_high=learner.clip_eps_high,
        gspo_clip_eps=learner.gspo_clip_eps,
        gspo_clip_eps_high=learner.gspo_clip_eps_high,
        cispo_clip_high=learner.cispo_clip_high,
        tis_cap=learner.tis_cap,
        mis_low=learner.mis_low,
        mis_high=learner.mis_high,
        kl_coef=learner.kl_coef,
        norm_length=learner.loss_norm_length or default_norm_length,
        proximal=learner.proximal_logprobs,
    )

  @property
  def needs_proximal(self) -> bool:
    """Whether the loss reads pi_prox (otherwise it only feeds the metrics)."""
    return self.loss == "decoupled_ppo" or self.correction != "none"
