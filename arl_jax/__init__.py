"""arl_jax: JAX-native asynchronous RL for language models, with explicit, bounded policy lag.

The names to script against (README "Python API"); everything else is
internal and reached by its module path:

    import arl_jax

    config = arl_jax.load_config("arith", "tiny")  # built-in, or "path/to/config.py"
    config.num_steps = 20
    spec = arl_jax.build_spec(config)  # validates: ConfigError names the key
    result = arl_jax.run(config, "/tmp/arith")  # trains; result.final_version, .history
    arl_jax.plot_all(["/tmp/arith"])  # reward, lag, ratio-by-lag, drops, busy (PNG)

Custom environments subclass `Environment` (or `MultiTurnEnvironment`) and
are registered by name with `register_env(name, EnvEntry(...))`.

Importing the package imports nothing heavy (no JAX): each name is loaded on
first use, so a launcher can set XLA flags after `import arl_jax`.
"""

from __future__ import annotations

import importlib

from arl_jax import _moved

# Old module paths (before the top level got its packages) still import, with
# a DeprecationWarning, for one release.
_moved.install()

# name -> (module, attribute)
_API = {
    "run": ("arl_jax.training.run_lib", "run"),
    "load_config": ("arl_jax.config.builtin", "load"),
    "config_names": ("arl_jax.config.builtin", "names"),
    "build_spec": ("arl_jax.config.run_spec", "build"),
    "ConfigError": ("arl_jax.config.run_spec", "ConfigError"),
    "Environment": ("arl_jax.envs.env_api", "Environment"),
    "MultiTurnEnvironment": ("arl_jax.envs.env_api", "MultiTurnEnvironment"),
    "TextPrompt": ("arl_jax.envs.env_api", "TextPrompt"),
    "EnvEntry": ("arl_jax.envs.registry", "EnvEntry"),
    "register_env": ("arl_jax.envs.registry", "register"),
    "plot_all": ("arl_jax.plot", "plot_all"),
    "load_run": ("arl_jax.plot", "Run"),
}

__all__ = sorted(_API)


def __getattr__(name: str):
  if name not in _API:
    raise AttributeError(f"module 'arl_jax' has no attribute {name!r} (the API: {__all__})")
  module, attribute = _API[name]
  value = getattr(importlib.import_module(module), attribute)
  globals()[name] = value  # (the next access is a plain lookup)
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_API))
