"""Imports every built-in tool module, so that each registers its tool.

Kept apart from the package's ``__init__`` (as ``rewards.builtin`` is) so the
executor can fill the registry without importing its own package: no import
cycle. A new built-in tool is one module plus its line here.
"""

from jax_dora.tools import calculator, python_exec  # noqa: F401  pylint: disable=unused-import
