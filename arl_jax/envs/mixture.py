"""Several environments in one run, chosen per prompt (`env.name = "mixture"`).

Config (nested under `env.components`, one entry per registered environment,
each with a sampling `weight` and that environment's own fields):

  config.env = dict(name="mixture", num_workers=4, timeout_s=30.0, components=dict(
      arith=dict(weight=0.7, max_operand=99),
      tool_agent=dict(weight=0.3, num_keys=1000)))

Every prompt is a `MixedPrompt` that names its environment; encoding, scoring,
demonstrations and (for multi-turn components) turns go to that environment,
and every rollout, reward and drop is reported under its name. The training
stream draws from the components in proportion to their weights (grain's
`MapDataset.mix`). With JSONL data every record must carry `env`.

When any component is multi-turn the mixture is too. Stop tokens stay per
prompt (`stop_ids_for`): the sampler ends a row's segment only on its own
environment's stop tokens (and the tokenizer's), so an arith completion that
writes tool_agent's `]` goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from arl_jax.envs import env_api, single_envs


@dataclasses.dataclass(frozen=True)
class MixedPrompt:
  """A component environment's prompt record, tagged with that environment."""

  env: str
  prompt: object

  @property
  def prompt_id(self) -> int:
    return self.prompt.prompt_id

  @property
  def text(self) -> str:
    return self.prompt.text


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureConfig:
  """Attributes:
    components: `{env name: {"weight": w, **that env's config fields}}`.
    weights, configs: derived, validated per component.
  """

  components: Mapping[str, Mapping]
  weights: Mapping[str, float] = dataclasses.field(init=False)
  configs: Mapping[str, object] = dataclasses.field(init=False)

  def __post_init__(self):
    known_envs = single_envs.SINGLE_ENVS
    if not self.components:
      raise ValueError("env.components is empty: a mixture needs at least one environment")
    weights, configs = {}, {}
    for name, fields in sorted(self.components.items()):
      where = f"env.components.{name}"
      if name not in known_envs:
        raise ValueError(f"{where}: unknown environment {name!r}; known: {sorted(known_envs)}")
      fields = dict(fields)
      weight = fields.pop("weight", None)
      if not isinstance(weight, (int, float)) or weight <= 0:
        raise ValueError(f"{where}.weight must be a number > 0, got {weight!r}")
      config_cls = known_envs[name].config_cls
      known = {f.name for f in dataclasses.fields(config_cls)}
      unknown = sorted(set(fields) - known)
      if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known | {'weight'})}")
      try:
        configs[name] = config_cls(**fields)
      except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e
      if known_envs[name].make_stream_fn is not None and known_envs[name].make_stream_fn(
          configs[name], 0) is not None:
        raise ValueError(f"{where}: its own training stream (a curriculum) cannot be mixed: "
                         "a mixture draws from each environment's shuffled prompts")
      weights[name] = float(weight)
    object.__setattr__(self, "weights", weights)
    object.__setattr__(self, "configs", configs)


class MixtureEnv(env_api.Environment):
  """Routes every call to the environment its prompt names."""

  name = "mixture"

  def __init__(self, envs: Mapping[str, object], weights: Mapping[str, float]):
    self.envs = dict(envs)
    self.weights = dict(weights)
    multi = [e for e in self.envs.values() if e.multi_turn]
    # Multi-turn when any component is; each prompt still stops on its own
    # environment's tokens (`stop_ids_for`) and only its own answers.
    self.multi_turn = bool(multi)
    self.stop_ids = tuple(sorted({i for e in multi for i in e.stop_ids}))

  def env_name_of(self, prompt: MixedPrompt) -> str:
    return prompt.env

  def stop_ids_for(self, prompt: MixedPrompt) -> tuple[int, ...]:
    """The stop tokens of the prompt's own environment."""
    return self.envs[prompt.env].stop_ids_for(prompt.prompt)

  def max_new_tokens_for(self, prompt: MixedPrompt) -> int | None:
    return self.envs[prompt.env].max_new_tokens_for(prompt.prompt)

  def encode_prompt(self, prompt: MixedPrompt) -> list[int]:
    return self.envs[prompt.env].encode_prompt(prompt.prompt)

  def score(self, prompt: MixedPrompt, completion_ids: Sequence[int]) -> float | env_api.Score:
    return self.envs[prompt.env].score(prompt.prompt, completion_ids)

  def demonstration(self, prompt: MixedPrompt) -> env_api.Demonstration:
    return self.envs[prompt.env].demonstration(prompt.prompt)

  def step(self, prompt: MixedPrompt, completion_ids: Sequence[int]) -> list[int] | None:
    env = self.envs[prompt.env]
    return env.step(prompt.prompt, completion_ids) if env.multi_turn else None


def make_env(cfg: MixtureConfig, tokenizer, for_eval: bool = False) -> MixtureEnv:
  """The mixture's `EnvEntry.make_env_fn`: each component built as its entry builds it."""
  envs = {name: single_envs.SINGLE_ENVS[name].make_env_fn(c, tokenizer, for_eval)
          for name, c in cfg.configs.items()}
  return MixtureEnv(envs, cfg.weights)


def make_prompts(cfg: MixtureConfig, split: str) -> list:
  """The mixture's `EnvEntry.make_prompts_fn`: every component's, tagged."""
  return [MixedPrompt(name, p) for name, c in cfg.configs.items()
          for p in single_envs.SINGLE_ENVS[name].make_prompts_fn(c, split)]
