"""Where a run's prompts come from: the environment's own records (generated,
or its bundled sample), or the user's JSONL files (`data.train_path`,
`data.heldout_path`; schema in `jsonl_source.py`)."""

from __future__ import annotations

import dataclasses

from arl_jax.envs import env_api, jsonl_source, mixture, registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """Attributes:
    train_path: JSONL file(s) of training prompts, comma-separated ("" = the env's own).
    heldout_path: JSONL file(s) of held-out prompts ("" = the env's own).
    on_malformed: `error` (stop, naming file:line) or `skip` (count and go on).
    num_epochs: passes over the training prompts (0: endless); the run ends
      early, after the last full batch, when they are used up.
  """

  train_path: str = ""
  heldout_path: str = ""
  on_malformed: str = "error"
  num_epochs: int = 0

  def __post_init__(self):
    if self.on_malformed not in jsonl_source.ON_MALFORMED:
      raise ValueError(f"data.on_malformed must be one of {jsonl_source.ON_MALFORMED}, got "
                       f"{self.on_malformed!r}")
    if type(self.num_epochs) is not int or self.num_epochs < 0:
      raise ValueError(f"data.num_epochs must be an int >= 0 (0: endless), got "
                       f"{self.num_epochs!r}")

  def path(self, split: str) -> str:
    if split not in env_api.SPLITS:
      raise ValueError(f"split must be one of {env_api.SPLITS}, got {split!r}")
    return self.train_path if split == "train" else self.heldout_path


@dataclasses.dataclass(frozen=True)
class Prompts:
  """One split's prompts and the malformed lines skipped while loading them."""

  prompts: list
  skipped: list[str]


def load(env_name: str, env_cfg, data: DataConfig, split: str) -> Prompts:
  """The prompts of `split` for environment `env_name` (configured by `env_cfg`)."""
  path = data.path(split)
  if not path:
    return Prompts(registry.ENVS[env_name].make_prompts_fn(env_cfg, split), [])
  paths = [p.strip() for p in path.split(",") if p.strip()]
  if env_name != "mixture":
    loaded = jsonl_source.load(paths, env_name=env_name, on_malformed=data.on_malformed)
    return Prompts(loaded.prompts, loaded.skipped)
  loaded = jsonl_source.load(paths, on_malformed=data.on_malformed,
                             mixture_envs=tuple(env_cfg.configs))
  return Prompts([mixture.MixedPrompt(env, p) for p, env in zip(loaded.prompts, loaded.envs)],
                 loaded.skipped)
