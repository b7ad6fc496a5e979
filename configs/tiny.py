"""Tiny CPU config: the README's main job and the tests' starting point.

Usage: python -m jax_dora.train --config=configs/tiny.py
Runs dora_pace, the system's point; the synchronous baseline is one override
away: --config.mode=sync.
"""

from jax_dora.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/tiny"
  c.mode = "dora_pace"
  c.total_steps = 60
  return c
