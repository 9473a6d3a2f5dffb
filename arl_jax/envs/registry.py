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
