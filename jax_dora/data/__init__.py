"""jax_dora.data."""
