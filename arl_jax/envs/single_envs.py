"""The single (non-mixture) environments by name, and what a registry entry holds.

`registry.ENVS` is this table plus the mixture, which is made of these
(`mixture.py` reads them here, so neither module imports the other's user).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from arl_jax.envs import (
  arith,
  humaneval_env,
  math_answer,
  reasoning_gym_curriculum,
  reasoning_gym_env,
  skyrl_gym_env,
  tool_agent,
)


@dataclasses.dataclass(frozen=True)
class EnvEntry:
  """Attributes:
    config_cls: frozen dataclass of the environment's settings.
    make_env_fn: `(config, tokenizer, for_eval) -> environment`; `for_eval`
      asks for a copy without simulated latency (evaluation waits on it).
    make_prompts_fn: `(config, split) -> list of prompt records` for `env_api.SPLITS`.
    check_record_fn: `(prompt record) -> None`, raising ValueError (naming the
      field) for a record of a data file this environment cannot use, beyond
      the file schema (`jsonl_source.py`); None: no further check.
    make_stream_fn: `(config, seed) -> stream or None`: the environment's
      own training stream (an iterator with `get_state` / `set_state`, and
      `observe(prompt_id, rewards)` and `metrics()` if its draws depend on
      the rewards: a curriculum), used in place of the shuffled
      `make_prompts_fn(config, "train")` when not None.
  """

  config_cls: type
  make_env_fn: Callable
  make_prompts_fn: Callable
  check_record_fn: Callable | None = None
  make_stream_fn: Callable | None = None


SINGLE_ENVS = {
    "arith": EnvEntry(arith.ArithConfig, lambda cfg, tok, for_eval=False: arith.ArithEnv(tok),
                      arith.make_prompts, arith.check_record),
    "math_answer": EnvEntry(
        math_answer.MathAnswerConfig,
        lambda cfg, tok, for_eval=False: math_answer.MathAnswerEnv(cfg, tok),
        math_answer.make_prompts),
    "tool_agent": EnvEntry(tool_agent.ToolAgentConfig, tool_agent.ToolAgentEnv,
                           tool_agent.make_prompts),
    "reasoning_gym": EnvEntry(reasoning_gym_env.ReasoningGymConfig, reasoning_gym_env.make_env,
                              reasoning_gym_env.make_prompts,
                              make_stream_fn=reasoning_gym_curriculum.make_stream),
    "humaneval": EnvEntry(humaneval_env.HumanEvalConfig, humaneval_env.make_env,
                          humaneval_env.make_prompts),
    "skyrl_gym": EnvEntry(skyrl_gym_env.SkyRLGymConfig, skyrl_gym_env.make_env,
                          skyrl_gym_env.make_prompts),
}
