"""The base of the typed config blocks: defaults, types, docs and checks in one place.

Each block of the run config (``model``, ``learner``, ``rollout``, ...) is a
frozen dataclass that owns its fields' defaults, types, one-line docs and
range checks (``__post_init__``). The ml_collections ``ConfigDict`` users
override on the command line (``--config.learner.learning_rate=1e-4``) is
*generated* from these classes (:func:`jax_dora.config.base_config`), so
unknown keys still fail at parse time; components turn their block of it
back into the typed class once (:meth:`ConfigBlock.of`) and read attributes
with their real types afterwards, never ``int(cfg.x)`` or ``cfg.get(x, default)``.
This module imports nothing from ``jax_dora``, so any module may import it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import ml_collections

B = TypeVar("B", bound="ConfigBlock")


class ConfigError(ValueError):
  """A config value is out of range or inconsistent with another."""


def _path(block: str, name: str) -> str:
  """``config.learner.loss`` (``config.mode`` for a top-level field)."""
  return f"config.{block}.{name}" if block else f"config.{name}"


def field(default: Any, doc: str = "") -> Any:
  """A block field with its default and the one-line doc the config reference shows."""
  return dataclasses.field(default=default, metadata={"doc": " ".join(doc.split())})


def choice(block: str, name: str, value: Any, allowed: typing.Iterable[Any]) -> None:
  """Raises a :class:`ConfigError` naming the field when ``value`` is not allowed."""
  allowed = tuple(allowed)
  if value not in allowed:
    raise ConfigError(f"{_path(block, name)}={value!r} is not one of {list(allowed)}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _coerce(block: str, name: str, value: Any, hint: Any) -> Any:
  """``value`` as the field's declared type (JSON configs carry 1 for 1.0)."""
  if value is None:
    return None
  is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
  options = typing.get_args(hint) if is_union else (hint,)
  options = tuple(o for o in options if o is not type(None))
  if len(options) != 1 or options[0] not in (int, float, str, bool):
    return value
  kind = options[0]
  if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
    return value
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if kind is int and isinstance(value, float) and value.is_integer():
    return int(value)
  raise ConfigError(f"{_path(block, name)}={value!r} must be a {kind.__name__}")


def _is_block(hint: Any) -> bool:
  return isinstance(hint, type) and issubclass(hint, ConfigBlock)


def _convert(block: str, name: str, value: Any, hint: Any) -> Any:
  """A nested block from its node, or a value coerced to the field's type."""
  if _is_block(hint):
    return hint.of(value)
  return _coerce(block, name, value, hint)


@dataclasses.dataclass(frozen=True)
class ConfigBlock:
  """One block of the run config; subclasses are frozen dataclasses of its fields."""

  # The block's key in the run config ("learner" for ``config.learner``).
  BLOCK: ClassVar[str] = ""

  @classmethod
  def of(cls: type[B], node: B | Mapping[str, Any] | ml_collections.ConfigDict) -> B:
    """The typed block from its ``ConfigDict`` node (or the block itself).

    Every key must be a field (a typo is an error, never a silent default);
    fields the node lacks keep their defaults, so configs written by older
    versions (a run's ``config.json``) still load.
    """
    if isinstance(node, cls):
      return node
    values = dict(node.to_dict() if hasattr(node, "to_dict") else node)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
      where = f"config.{cls.BLOCK}" if cls.BLOCK else "config"
      raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(names)}")
    hints = _field_types(cls)
    return cls(**{k: _convert(cls.BLOCK, k, v, hints[k]) for k, v in values.items()})

  def to_dict(self) -> dict[str, Any]:
    """Plain values, nested blocks as nested dicts (what a ``ConfigDict`` is built from)."""
    return {f.name: (v.to_dict() if isinstance(v := getattr(self, f.name), ConfigBlock) else v)
            for f in dataclasses.fields(self)}

  def to_config_dict(self) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(self.to_dict())

  @classmethod
  def docs(cls) -> dict[str, str]:
    """Each field's one-line doc by dotted path (the config reference's description column)."""
    hints = _field_types(cls)
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
      if _is_block(hints[f.name]):
        out.update({f"{f.name}.{k}": v for k, v in hints[f.name].docs().items()})
      else:
        out[f.name] = f.metadata.get("doc", "")
    return out

  def fail(self, name: str, why: str) -> typing.NoReturn:
    """Raises ``config.<block>.<name>=<value> <why>`` (``why``: "must be >= 0", ...)."""
    raise ConfigError(f"{_path(self.BLOCK, name)}={getattr(self, name)!r} {why}")
