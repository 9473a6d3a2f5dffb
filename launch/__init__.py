"""Launchers that run many `arl_jax.launch` jobs: local sweeps (and, later, XManager)."""
