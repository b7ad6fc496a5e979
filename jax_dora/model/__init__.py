"""jax_dora.model."""
