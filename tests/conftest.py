"""Test setup: 8 fake CPU devices, set before JAX initialises.

Every test module imports JAX after this file runs, so meshes of up to 8
devices (4 learner / 4 sampler by default) exercise real sharding on one CPU.
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, (
    "tests need 8 fake CPU devices; JAX was initialised before tests/conftest.py ran")
