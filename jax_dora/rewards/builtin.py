"""Imports every built-in reward module, so that each registers its reward.

The package imports it, and so does every scorer worker process (which
needs the registry filled before it looks a name up); keeping it apart from
the package's ``__init__`` is what lets the scorer import it without
importing its own package (no import cycle). A new built-in reward is one
module plus its line here.
"""

from jax_dora.rewards import format, math_reward, task  # noqa: F401  pylint: disable=redefined-builtin,unused-import
