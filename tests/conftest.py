"""Test setup: 8 fake CPU devices, set before JAX initialises.

Every test module imports JAX after this file runs, so meshes of up to 8
devices (4 learner / 4 sampler by default) exercise real sharding on one CPU.
The LLVM backend runs at optimisation level 0 (`arl_jax/testing/xla_env.py`):
test time is mostly compile time, and that cuts it by ~40%.

Compiled programs go to a persistent compilation cache shared by the whole
session, subprocesses included (they inherit the environment): many tests
build the same tiny model's update and sampler functions, and a cache hit
costs ~0.1 s where a compile costs seconds. In-memory jit caches (which the
compile-count tests inspect) are unaffected.
"""

import atexit
import os
import shutil
import tempfile

from arl_jax.testing import xla_env  # (imports no JAX)

# 8 devices, and cheap compiles (`xla_env`: LLVM at optimisation level 0).
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), xla_env.xla_flags(device_count=8)]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="arl_jax_test_jit_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

assert jax.device_count() == 8, (
    "tests need 8 fake CPU devices; JAX was initialised before tests/conftest.py ran")
