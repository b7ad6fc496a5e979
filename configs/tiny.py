"""Tiny CPU config: the README's main job and the tests' starting point.

Usage: python -m jax_dora.train --config=configs/tiny.py --config.mode=dora_pace
"""

from jax_dora.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/tiny"
  c.mode = "sync"
  c.total_steps = 60
  return c
