"""Name -> function registries for the learner's loss pieces.

A run picks its objective, importance-sampling correction, loss aggregation
and advantage estimator by name (``learner.loss``, ``learner.is_correction``,
``learner.loss_aggregation``, ``learner.advantage_estimator``), as Tunix and
verl do: adding one is one decorated function in the module that holds its
kind, and the config validator lists what exists from these registries.
"""

from __future__ import annotations

from collections.abc import Callable

from jax_dora.registry import Registry

OBJECTIVES: Registry[Callable] = Registry("loss", plural="losses")
CORRECTIONS: Registry[Callable] = Registry("importance-sampling correction")
AGGREGATIONS: Registry[Callable] = Registry("loss aggregation")
ADVANTAGES: Registry[Callable] = Registry("advantage estimator")

__all__ = ["ADVANTAGES", "AGGREGATIONS", "CORRECTIONS", "OBJECTIVES", "Registry"]
