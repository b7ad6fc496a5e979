"""jax_dora.metrics."""
