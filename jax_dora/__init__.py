"""jax-dora: asynchronous RL post-training with DORA multi-version streaming rollout and PACE."""

__version__ = "0.1.0"
