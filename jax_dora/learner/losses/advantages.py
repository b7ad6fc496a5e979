"""Group-relative advantage estimators: ``learner.advantage_estimator``.

Host-side numpy on rewards ordered group by group (``[g0m0, g0m1, ...,
g1m0, ...]``); a group whose members all scored the same yields zeros with
every estimator (no learning signal).

* ``grpo``: ``(r - mean) / (std + eps)`` within the group.
* ``drgrpo`` (Dr.GRPO): ``r - mean``; dividing by the std up-weights groups
  that are nearly all right or all wrong (a difficulty bias).
* ``rloo`` (REINFORCE leave-one-out): ``r_i - mean_{j != i} r_j``, an
  unbiased baseline, equal to ``G / (G - 1) * (r - mean)``.
"""

from __future__ import annotations

import numpy as np

from jax_dora.learner.losses.registry import ADVANTAGES


def _groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
  r = np.asarray(rewards, dtype=np.float32)
  if r.size % group_size:
    raise ValueError(f"{r.size} rewards is not a whole number of groups of {group_size}")
  return r.reshape(-1, group_size)


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
  g = _groups(rewards, group_size)
  adv = g - g.mean(axis=1, keepdims=True)
  std = g.std(axis=1, keepdims=True) + eps
  return np.divide(adv, std, out=np.zeros_like(adv), where=std > 0).reshape(-1)


@ADVANTAGES.register("drgrpo")
def drgrpo_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
  del eps
  g = _groups(rewards, group_size)
  return (g - g.mean(axis=1, keepdims=True)).reshape(-1)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
  del eps
  g = _groups(rewards, group_size)
  others = (g.sum(axis=1, keepdims=True) - g) / (group_size - 1)
  return (g - others).reshape(-1)


def compute_advantages(name: str, rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
  return ADVANTAGES.get(name)(rewards, group_size, eps)
