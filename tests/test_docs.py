"""The committed config reference must match what the generator prints.

docs/CONFIG_REFERENCE.md is generated from ``jax_dora.config.base_config`` and
``configs/*.py`` (``make docs``); this test keeps it from drifting when a field
or a default changes without regenerating it.
"""

from __future__ import annotations

import importlib.util
import pathlib

from jax_dora.config import base_config

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_DOC = _ROOT / "docs" / "CONFIG_REFERENCE.md"


def _generator():
  spec = importlib.util.spec_from_file_location(
      "gen_config_reference", _ROOT / "scripts" / "gen_config_reference.py"
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_config_reference_is_up_to_date():
  expected = _generator().render()
  actual = _DOC.read_text()
  assert actual == expected, (
      "docs/CONFIG_REFERENCE.md is out of date; regenerate it with `make docs`"
  )


def test_every_config_field_is_documented():
  doc = _DOC.read_text()
  cfg = base_config()
  for section in cfg.keys():
    value = cfg[section]
    if hasattr(value, "keys"):
      for key in value.keys():
        assert f"`{section}.{key}" in doc, f"{section}.{key} missing from the reference"
      assert any(f"| `{section}." in line for line in doc.splitlines()), section
    else:
      assert f"| `{section}` |" in doc, f"{section} missing from the reference"
