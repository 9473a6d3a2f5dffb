"""Environments by name: the one dict that config validation and runs both read.

An entry says how to build an environment's config (a frozen dataclass whose
fields are the keys of the config's `env` section), the environment itself,
and its prompt splits: the single environments (`single_envs.py`) and the
mixture of them.
"""

from __future__ import annotations

from arl_jax.envs import mixture, single_envs

EnvEntry = single_envs.EnvEntry

ENVS = {
    **single_envs.SINGLE_ENVS,
    "mixture": EnvEntry(mixture.MixtureConfig, mixture.make_env, mixture.make_prompts),
}


def register(name: str, entry: EnvEntry, *, replace: bool = False) -> None:
  """Adds environment `name` (a config's `env.name`) for this process's runs.
  A mixture can then use it too. Sampler processes and the other processes
  of a multi-controller job build environments themselves: each must
  register it as well (import the module that does, e.g. from a
  `sitecustomize` or the config file).

  Raises:
    ValueError: `name` is taken (and not `replace`), or `entry` is not an
      `EnvEntry`.
  """
  if not isinstance(entry, EnvEntry):
    raise ValueError(f"register({name!r}, ...) takes an EnvEntry(config_cls, make_env_fn, "
                     f"make_prompts_fn), got {type(entry).__name__}")
  if name in ENVS and not replace:
    raise ValueError(f"environment {name!r} is already registered (built-in or earlier); pass "
                     "replace=True to replace it")
  ENVS[name] = entry
  single_envs.SINGLE_ENVS[name] = entry
