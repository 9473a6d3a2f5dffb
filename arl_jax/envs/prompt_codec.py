"""Prompt records as JSON, for checkpoints (no pickle): `TextPrompt`, and a
mixture's `MixedPrompt` around one."""

from __future__ import annotations

import dataclasses

from arl_jax.envs import env_api, mixture


def to_json(prompt) -> dict:
  if isinstance(prompt, mixture.MixedPrompt):
    return {"env": prompt.env, "prompt": to_json(prompt.prompt)}
  if isinstance(prompt, env_api.TextPrompt):
    return dataclasses.asdict(prompt)
  raise TypeError(f"cannot checkpoint a prompt record of type {type(prompt).__name__}; "
                  "environments should use env_api.TextPrompt")


def from_json(record: dict):
  if "env" in record:
    return mixture.MixedPrompt(record["env"], from_json(record["prompt"]))
  return env_api.TextPrompt(**record)
