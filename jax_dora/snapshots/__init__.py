"""jax_dora.snapshots."""
