"""Name -> function registries for the learner's loss pieces.

A run picks its objective, importance-sampling correction, loss aggregation
and advantage estimator by name (``learner.loss``, ``learner.is_correction``,
``learner.loss_aggregation``, ``learner.advantage_estimator``), as Tunix and
verl do: adding one is one decorated function in the module that holds its
kind, and the config validator lists what exists from these registries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
  """Functions of one kind (objective, correction, ...) by name."""

  def __init__(self, kind: str):
    self.kind = kind
    self._fns: dict[str, F] = {}

  def register(self, name: str) -> Callable[[F], F]:
    def add(fn: F) -> F:
      if name in self._fns:
        raise ValueError(f"{self.kind} {name!r} is registered twice")
      self._fns[name] = fn
      return fn
    return add

  def get(self, name: str) -> F:
    try:
      return self._fns[name]
    except KeyError:
      raise KeyError(f"unknown {self.kind} {name!r}; known: {self.names()}") from None

  def names(self) -> list[str]:
    return sorted(self._fns)


OBJECTIVES: Registry = Registry("loss")
CORRECTIONS: Registry = Registry("importance-sampling correction")
AGGREGATIONS: Registry = Registry("loss aggregation")
ADVANTAGES: Registry = Registry("advantage estimator")
