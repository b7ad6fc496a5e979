"""Tiny CPU config: a 2-layer character policy trained from scratch, the tests' starting point.

Usage: python -m jax_dora.train --config=configs/tiny.py
Runs dora_pace on toy string tasks in about a minute; the fast tests start
here. The README's main job is RL from the shipped pretrained base model,
``configs/tiny_math.py``.
"""

from jax_dora.config import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/tiny"
  c.mode = "dora_pace"
  c.total_steps = 60
  # Compile every shape before the clock starts. Off, the servers compile the
  # 2- and 3-version decode steps when they first meet them, mid-run: measured
  # here, that stalled the learner 24 s of a 66 s run (527 trained tok/s vs
  # 1306 with it, for 7 s more start-up). Tests that run this config for a few
  # steps pass --config.precompile=False.
  c.precompile = True
  return c
