"""jax_dora.learner."""
