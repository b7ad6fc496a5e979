"""jax_dora.rollout."""
