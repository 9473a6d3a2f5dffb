"""JAX's persistent compilation cache for runs (`config.compilation_cache`).

A run compiles the learner's update, the evaluation's and every sampler
program before its first update (minutes at real size, `benchmarks/README.md`);
with the cache on, XLA's executables are written to a folder keyed by the
program, its shapes, the devices and the JAX/XLA versions, and a second start
of the same config (a restart after preemption, a resumed or repeated run, a
sweep's next trial with the same shapes) reads them instead of compiling.

"auto" uses the folder JAX is already told to use (`JAX_COMPILATION_CACHE_DIR`
or `jax.config`), else `$ARL_JAX_CACHE_DIR`, else
`$XDG_CACHE_HOME/arl_jax/jit` (`~/.cache/arl_jax/jit`); a path uses that
folder; "" turns the cache off for the process. Every program is cached,
however quickly it compiled (a paged engine's many small programs add up).
The folder can be deleted at any time. JAX writes an entry in one call, not
atomically: a process killed inside that call leaves a damaged entry, which
JAX warns about and compiles again (delete the folder to be rid of it).
"""

from __future__ import annotations

import os
import threading

import jax

AUTO = "auto"


def default_dir() -> str:
  """`$ARL_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/arl_jax/jit` (`~/.cache/...`)."""
  if os.environ.get("ARL_JAX_CACHE_DIR"):
    return os.environ["ARL_JAX_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "arl_jax", "jit")


def enable(setting: str) -> str | None:
  """Points JAX's persistent cache at the folder `setting` names ("auto", a
  path, or "" for off: see the module docstring); the folder in use, or
  None when off. Call before the run compiles (a notebook's earlier
  compilations stay in memory either way)."""
  from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415

  current = jax.config.jax_compilation_cache_dir
  if setting == "":
    if current is not None or jax.config.jax_enable_compilation_cache:
      jax.config.update("jax_enable_compilation_cache", False)
      compilation_cache.reset_cache()
    return None
  folder = (current or default_dir()) if setting == AUTO else setting
  folder = os.path.abspath(os.path.expanduser(folder))
  os.makedirs(folder, exist_ok=True)
  if not jax.config.jax_enable_compilation_cache or current != folder:
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.reset_cache()  # (re-read on the next compile)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return folder


def describe(folder: str | None) -> str:
  """`compilation cache: /root/.cache/arl_jax/jit (120 programs, 35 MB)` or `... off`."""
  if folder is None:
    return "compilation cache: off (config.compilation_cache='')"
  entries = sizes = 0
  try:
    with os.scandir(folder) as it:
      for entry in it:
        if entry.name.endswith("-cache"):
          entries += 1
          sizes += entry.stat().st_size
  except OSError:
    pass
  return f"compilation cache: {folder} ({entries} programs, {sizes / 1e6:.0f} MB)"


# `jax.monitoring` events: one duration event per new executable (an
# in-memory jit cache miss), whether XLA compiled it or the persistent cache
# supplied it; a cache hit event just before it when the cache did.
_PROGRAM_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class ProgramCounter:
  """Counts the executables this process builds while it is open, and how
  many of them the persistent cache supplied (`with ProgramCounter() as c`).
  Counts every thread's; two counters open at once both count."""

  def __init__(self):
    self._lock = threading.Lock()
    self._hit = threading.local()
    self.programs = 0
    self.from_cache = 0

  def __enter__(self) -> ProgramCounter:
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_listener(self._on_event)
    jax.monitoring.unregister_event_duration_listener(self._on_duration)

  def _on_event(self, event: str, **kwargs) -> None:
    if event == _CACHE_HIT_EVENT:
      self._hit.value = True

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    if event != _PROGRAM_EVENT:
      return
    hit, self._hit.value = getattr(self._hit, "value", False), False
    with self._lock:
      self.programs += 1
      self.from_cache += hit

  def summary(self) -> str:
    """`57 programs (57 from the cache)`."""
    with self._lock:
      return f"{self.programs} programs ({self.from_cache} from the cache)"
