"""jax_dora.orchestrator."""
