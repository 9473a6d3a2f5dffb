"""XLA flags for test processes: fake CPU devices and cheap compiles.

The test models are tiny, so a test's time is almost all XLA compilation,
and most of that is LLVM optimising the generated machine code. Tests run
with the LLVM backend at optimisation level 0: the same HLO passes (fusion,
sharding propagation, collectives) and the same numbers to float rounding,
at ~40% less compile time (measured on two compile-bound tests, 83 s -> 49
s). They also emit fused computations with XLA's older elemental emitters
instead of its MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`;
fewer compiler passes; a program may fuse, so round, differently: the same
numbers to float rounding): a further 30-50% off compile-bound test files
(2026-12-04, fresh compilation cache each, side by side:
`learner/packed_update_test.py` 68-83 s -> 40 s, `learner/update_test.py`
111 -> 72 s, `sampler/chunked_prefill_test.py` 85 -> 59 s). The flags are
jaxlib 0.10's (an unknown flag stops XLA at start-up). Benchmarks and runs
keep XLA's defaults.

`tests/conftest.py` sets these flags for the test session; a test that starts
a subprocess with another device count passes `subprocess_env(n)`.
"""

from __future__ import annotations

import os

COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def xla_flags(device_count: int | None = None) -> str:
  """`XLA_FLAGS` for a test process with `device_count` fake CPU devices
  (None: one, XLA's default)."""
  flags = list(COMPILE_FLAGS)
  if device_count is not None:
    flags.insert(0, f"--xla_force_host_platform_device_count={device_count}")
  return " ".join(flags)


def subprocess_env(device_count: int | None = None,
                   compilation_cache: str | None = None) -> dict[str, str]:
  """This process's environment with `XLA_FLAGS` for a child of
  `device_count` fake CPU devices; with `compilation_cache`, JAX's
  persistent cache in that folder for every program (children that run the
  same programs one after another compile them once; for runs that end
  cleanly: a killed child may leave an entry half written)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(device_count))
  if compilation_cache is not None:
    env.update(JAX_COMPILATION_CACHE_DIR=compilation_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env
