"""Where a run's prompts come from: the environment's own records (generated,
or its bundled sample), or the user's JSONL files (`data.train_path`,
`data.heldout_path`; schema in `jsonl_source.py`).

A file's record is checked by its environment too (`EnvEntry.check_record_fn`), and one
whose prompt is longer than `sampler.prompt_len` is a bad line of its file
like any other: `run_spec.build` (which has the tokenizer) finds them with
`drop_long_prompts` and lists them in `DataConfig.too_long`, so that every
later `load` of the same config skips them (with `on_malformed="skip"`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from arl_jax.core import settings
from arl_jax.envs import env_api, jsonl_source, mixture, registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """Attributes:
    train_path: JSONL file(s) of training prompts, comma-separated ("" = the env's own).
    heldout_path: JSONL file(s) of held-out prompts ("" = the env's own).
    on_malformed: `error` (stop, naming file:line) or `skip` (count and go on).
    num_epochs: passes over the training prompts (0: endless); the run ends
      early, after the last full batch, when they are used up.
    too_long: `(file:line, problem)` of the lines whose prompt is longer than
      `sampler.prompt_len`, skipped by `load`. Not a config key: set by
      `run_spec.build` through `drop_long_prompts`.
  """

  train_path: str = ""
  heldout_path: str = ""
  on_malformed: str = "error"
  num_epochs: int = 0
  too_long: tuple[tuple[str, str], ...] = settings.derived((), "the prompt files")

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
  """One split's prompts and the malformed lines skipped while loading them.

  Attributes:
    prompts: the prompt records.
    skipped: `file:line: problem` of each skipped line (the malformed ones in
      file order, then those too long).
    wheres: each prompt's `file:line`; empty for the environment's own prompts.
  """

  prompts: list
  skipped: list[str]
  wheres: list[str] = dataclasses.field(default_factory=list)


def _check_record(prompt: env_api.TextPrompt, env_name: str | None) -> None:
  check = registry.ENVS[env_name].check_record_fn if env_name in registry.ENVS else None
  if check is not None:
    check(prompt)


def _without(loaded: Prompts, too_long: dict[str, str]) -> Prompts:
  """`loaded` less the lines in `too_long`, which join its skipped lines."""
  if not any(where in too_long for where in loaded.wheres):
    return loaded
  kept = [(p, w) for p, w in zip(loaded.prompts, loaded.wheres) if w not in too_long]
  return Prompts([p for p, _ in kept],
                 loaded.skipped + [f"{w}: {too_long[w]}" for w in loaded.wheres if w in too_long],
                 [w for _, w in kept])


def load(env_name: str, env_cfg, data: DataConfig, split: str) -> Prompts:
  """The prompts of `split` for environment `env_name` (configured by `env_cfg`).

  Raises:
    jsonl_source.MalformedRecord: naming file:line, for a bad line when
      `data.on_malformed == "error"`.
    FileNotFoundError: for a missing file.
  """
  path = data.path(split)
  if not path:
    return Prompts(registry.ENVS[env_name].make_prompts_fn(env_cfg, split), [])
  paths = [p.strip() for p in path.split(",") if p.strip()]
  if env_name != "mixture":
    loaded = jsonl_source.load(paths, env_name=env_name, on_malformed=data.on_malformed,
                               check_fn=_check_record)
    prompts = loaded.prompts
  else:
    loaded = jsonl_source.load(paths, on_malformed=data.on_malformed,
                               mixture_envs=tuple(env_cfg.configs), check_fn=_check_record)
    prompts = [mixture.MixedPrompt(env, p) for p, env in zip(loaded.prompts, loaded.envs)]
  return _without(Prompts(prompts, loaded.skipped, loaded.wheres), dict(data.too_long))


def drop_long_prompts(data: DataConfig, loaded: Prompts,
                      length_fn: Callable[[object], int],
                      prompt_len: int) -> tuple[DataConfig, Prompts]:
  """Finds the file prompts longer than `prompt_len` tokens.

  Args:
    data: the data config `loaded` came from.
    loaded: one split's prompts, from `load(..., data, ...)`.
    length_fn: a prompt's length in tokens, as the environment encodes it.
    prompt_len: `sampler.prompt_len`.

  Returns:
    `(data, loaded)` with those lines added to `data.too_long` and moved to
    `loaded.skipped`. The environment's own prompts are not checked here.

  Raises:
    jsonl_source.MalformedRecord: naming the first such line's file:line,
      when `data.on_malformed == "error"`.
  """
  too_long = {}
  for prompt, where in zip(loaded.prompts, loaded.wheres):
    length = length_fn(prompt)
    if length > prompt_len:
      too_long[where] = (f"prompt has {length} tokens, more than "
                         f"sampler.prompt_len={prompt_len}")
  if not too_long:
    return data, loaded
  if data.on_malformed == "error":
    where, problem = next(iter(too_long.items()))
    others = f"; {len(too_long) - 1} more line(s) too long" if len(too_long) > 1 else ""
    raise jsonl_source.MalformedRecord(
        f"{where}: {problem}{others} (raise sampler.prompt_len, or skip such lines with "
        "data.on_malformed='skip')")
  data = dataclasses.replace(data, too_long=tuple({**dict(data.too_long), **too_long}.items()))
  return data, _without(loaded, too_long)
