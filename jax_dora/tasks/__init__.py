"""jax_dora.tasks."""
