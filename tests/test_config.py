"""Config: typos and bad values fail loudly before anything runs."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from jax_dora.config import ConfigError, base_config, validate

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_train(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, "-m", "jax_dora.train", "--config=configs/tiny.py", *args],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
  )


def test_unknown_config_key_fails_with_clear_message():
  proc = _run_train("--config.learner.learning_rat=0.1")
  assert proc.returncode != 0
  assert "learning_rat" in proc.stderr
  assert "Traceback" not in proc.stderr.splitlines()[-1]


def test_bad_value_is_rejected_by_validation():
  proc = _run_train("--config.mode=fastest")
  assert proc.returncode == 2
  assert "config.mode='fastest'" in proc.stderr


def test_validate_catches_inconsistent_lengths():
  c = base_config()
  c.rollout.max_new_tokens = 1000
  with pytest.raises(ConfigError, match="max_seq_len"):
    validate(c)
  validate(base_config())
