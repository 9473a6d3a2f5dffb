"""The base every experiment config derives from.

`make(env)` is a ConfigDict with every section and every key the schema
(`schema.SECTIONS`) declares with a default, at that default, and
the environment's own keys at theirs. A config file states what differs:

  config = base_config.make("arith")
  config.num_steps = 3000
  config.sampler.update(num_slots=128, prompt_len=8, max_new_tokens=5)

so a key added to the schema reaches every config, and `--config.KEY=...`,
with its default, without touching them. Keys without a default (the
model's shape, the batch, the prompt length) are the config's to give.
"""

from __future__ import annotations

import ml_collections

from arl_jax.config import schema
from arl_jax.core import settings
from arl_jax.envs import registry


def make(env: str) -> ml_collections.ConfigDict:
  """An unlocked ConfigDict of the schema's defaults, with environment `env`
  (a name of `registry.ENVS`) at its config class's defaults.

  Raises:
    ValueError: for an unknown environment, naming the known ones.
  """
  if env not in registry.ENVS:
    raise ValueError(f"unknown environment {env!r}; known: {sorted(registry.ENVS)}")
  config = ml_collections.ConfigDict(settings.defaults(schema.RunSection))
  for name, classes in schema.SECTIONS.items():
    section = {}
    for cls in classes:
      section.update(settings.defaults(cls))
    if name == "env":
      section.update(name=env, **settings.defaults(registry.ENVS[env].config_cls))
    parent, _, key = name.rpartition(".")  # (`learner.lora`: inside `learner`)
    (config[parent] if parent else config)[key] = ml_collections.ConfigDict(section)
  return config
