"""The learner's loss pieces, each chosen by name (see :mod:`.registry`).

Importing the modules registers their functions; ``registry`` lists them.
"""

from jax_dora.learner.losses import advantages, aggregation, corrections, objectives  # noqa: F401  (registration)
from jax_dora.learner.losses.advantages import compute_advantages
from jax_dora.learner.losses.aggregation import BatchTotals
from jax_dora.learner.losses.policy_loss import LossOutput, loglinear_proximal, policy_loss
from jax_dora.learner.losses.registry import ADVANTAGES, AGGREGATIONS, CORRECTIONS, OBJECTIVES
from jax_dora.learner.losses.settings import LossSettings

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "CORRECTIONS", "OBJECTIVES", "BatchTotals", "LossOutput",
    "LossSettings", "compute_advantages", "loglinear_proximal", "policy_loss",
]
