"""One name -> object registry type for every pluggable kind.

Losses, rewards, dataset formats, model families and tasks are all chosen by
name from a config, and all need the same things: adding one is one file plus
one ``register`` line, a name registered twice by mistake fails at import (not
as a silently shadowed entry), and an unknown name in a config fails with the
list of names that exist. One type keeps those rules and messages identical
across kinds. A leaf module (no ``jax_dora`` imports), so any module may use it
without creating an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, overload

T = TypeVar("T")

_UNSET = object()


class UnknownNameError(KeyError):
  """``get`` of a name nobody registered.

  A ``KeyError`` so callers (and tests) that catch the dict-style error keep
  working; ``str()`` is the plain message (``KeyError`` would quote it).
  """

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else ""


class DuplicateNameError(ValueError):
  """``register`` of a second, different object under a name already taken."""


class Registry(Generic[T]):
  """Objects of one kind by name.

  Args:
    kind: What is registered, as a config or error message names it
      (``"loss"``, ``"reward"``, ``"data.format"``); starts every error.
    plural: How the list of known names is introduced in the unknown-name
      error (``"known {plural}: [...]"``); defaults to ``kind + "s"``.
  """

  def __init__(self, kind: str, plural: str | None = None):
    self.kind = kind
    self.plural = plural if plural is not None else f"{kind}s"
    self._objs: dict[str, T] = {}

  @overload
  def register(self, name: str) -> Callable[[T], T]: ...

  @overload
  def register(self, name: str, obj: T) -> T: ...

  def register(self, name, obj=_UNSET):
    """Adds ``obj`` under ``name`` and returns it; without ``obj``, a decorator that does.

    Registering the same object again is a no-op, so a registration line
    that runs twice is harmless; "the same" means identical or equal, so a
    wrapper that rebuilds an equal frozen record (``Reward(name, fn, ...)``)
    for the same function counts. A different object under a taken name raises
    :class:`DuplicateNameError`: two plugins silently shadowing each other
    would change a run's behaviour with no trace in its config.
    """
    if obj is _UNSET:
      return lambda o: self.register(name, o)
    if name in self._objs:
      existing = self._objs[name]
      if existing is not obj and existing != obj:
        raise DuplicateNameError(
            f"{self.kind} {name!r} is registered twice: {existing!r} and {obj!r}")
      return obj
    self._objs[name] = obj
    return obj

  def get(self, name: str) -> T:
    """The object under ``name``; an unknown name lists the known ones (a config typo)."""
    try:
      return self._objs[name]
    except KeyError:
      raise UnknownNameError(
          f"unknown {self.kind} {name!r}; known {self.plural}: {self.names()}") from None

  def names(self) -> list[str]:
    """Registered names, sorted (stable in error messages and docs)."""
    return sorted(self._objs)

  def items(self) -> list[tuple[str, T]]:
    """``(name, object)`` pairs in name order."""
    return [(n, self._objs[n]) for n in self.names()]

  def __contains__(self, name: object) -> bool:
    return name in self._objs

  def __iter__(self) -> Iterator[str]:
    """Names in sorted order, like iterating a dict gives its keys."""
    return iter(self.names())

  def __len__(self) -> int:
    return len(self._objs)

  def __repr__(self) -> str:
    return f"Registry({self.kind!r}, names={self.names()})"
