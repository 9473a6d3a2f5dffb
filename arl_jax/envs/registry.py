"""Environments by name: the one dict that config validation and runs both read.

An entry says how to build an environment's config (a frozen dataclass whose
fields are the keys of the config's `env` section), the environment itself,
and its prompt splits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from arl_jax.envs import arith, math_answer, mixture, tool_agent


@dataclasses.dataclass(frozen=True)
class EnvEntry:
  """Attributes:
    config_cls: frozen dataclass of the environment's settings.
    make_env_fn: `(config, tokenizer, for_eval) -> environment`; `for_eval`
      asks for a copy without simulated latency (evaluation waits on it).
    make_prompts_fn: `(config, split) -> list of prompt records` for `env_api.SPLITS`.
  """

  config_cls: type
  make_env_fn: Callable
  make_prompts_fn: Callable


def _make_mixture_env(cfg: mixture.MixtureConfig, tokenizer, for_eval: bool = False):
  envs = {name: ENVS[name].make_env_fn(c, tokenizer, for_eval) for name, c in cfg.configs.items()}
  return mixture.MixtureEnv(envs, cfg.weights)


def _make_mixture_prompts(cfg: mixture.MixtureConfig, split: str) -> list:
  return [mixture.MixedPrompt(name, p) for name, c in cfg.configs.items()
          for p in ENVS[name].make_prompts_fn(c, split)]


ENVS = {
    "arith": EnvEntry(arith.ArithConfig, lambda cfg, tok, for_eval=False: arith.ArithEnv(tok),
                      arith.make_prompts),
    "math_answer": EnvEntry(
        math_answer.MathAnswerConfig,
        lambda cfg, tok, for_eval=False: math_answer.MathAnswerEnv(cfg, tok),
        math_answer.make_prompts),
    "tool_agent": EnvEntry(tool_agent.ToolAgentConfig, tool_agent.ToolAgentEnv,
                           tool_agent.make_prompts),
    "mixture": EnvEntry(mixture.MixtureConfig, _make_mixture_env, _make_mixture_prompts),
}
