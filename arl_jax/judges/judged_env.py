"""An environment whose reward is its own and a judge's, combined with
weights: `rule_weight * rule + weight * judge`, both logged as parts
(`reward_parts`: `rule`, `judge`, and the environment's own parts).

The judge is asked at `score`, in the environment worker thread that scores
the rollout, as the rollout finishes (the `hf` judge batches the questions
of concurrent workers): off the learner's critical path. A judge that fails
raises, which the env runner counts as the rollout's fault. Everything else
is the wrapped environment's.
"""

from __future__ import annotations

from collections.abc import Sequence

from arl_jax.envs import env_api
from arl_jax.judges import judge_config


def make_judge(cfg: judge_config.JudgeConfig):
  """The configured judge (`hf` and `reward_model` load their model now)."""
  if cfg.kind == "hf":
    from arl_jax.judges import model_judge  # noqa: PLC0415 - JAX work only when asked

    return model_judge.ModelJudge(cfg)
  if cfg.kind == "reward_model":
    from arl_jax.judges import reward_model  # noqa: PLC0415

    return reward_model.RewardModel(cfg)
  if cfg.kind == "openai":
    from arl_jax.judges import openai_judge  # noqa: PLC0415

    return openai_judge.OpenAIJudge(cfg)
  raise ValueError(f"judge.kind={cfg.kind!r} makes no judge")


def prompt_text(prompt) -> str | None:
  """The task's text of a prompt record (a mixture's holds its component's)."""
  while not hasattr(prompt, "text") and hasattr(prompt, "prompt"):
    prompt = prompt.prompt
  return getattr(prompt, "text", None)


class JudgedEnvironment(env_api.Environment):
  """`env` with a judge's verdict in its reward."""

  def __init__(self, env: env_api.Environment, judge, cfg: judge_config.JudgeConfig,
               tokenizer):
    self._env, self.judge, self._cfg, self._tokenizer = env, judge, cfg, tokenizer
    self.name = env.name
    self.multi_turn = env.multi_turn
    self.stop_ids = env.stop_ids

  @classmethod
  def make(cls, *, env: env_api.Environment, cfg: judge_config.JudgeConfig, tokenizer):
    """`env` judged by the judge `cfg` describes (made now: `hf` loads its model)."""
    return cls(env, make_judge(cfg), cfg, tokenizer)

  def encode_prompt(self, prompt) -> list[int]:
    return self._env.encode_prompt(prompt)

  def step(self, prompt, completion_ids: Sequence[int]):
    return self._env.step(prompt, completion_ids)

  def demonstration(self, prompt):
    return self._env.demonstration(prompt)

  def env_name_of(self, prompt) -> str:
    return self._env.env_name_of(prompt)

  def stop_ids_for(self, prompt):
    return self._env.stop_ids_for(prompt)

  def max_new_tokens_for(self, prompt):
    return self._env.max_new_tokens_for(prompt)

  def score(self, prompt, completion_ids: Sequence[int]) -> env_api.Score:
    rule = env_api.to_score(self._env.score(prompt, completion_ids))
    stops = set(self._tokenizer.stop_ids)
    completion = self._tokenizer.decode([int(t) for t in completion_ids if int(t) not in stops])
    question = prompt_text(prompt)
    if question is None:  # (a record without text: the prompt as the policy saw it)
      question = self._tokenizer.decode(self.encode_prompt(prompt))
    verdict = float(self.judge.verdict(question, completion))
    reward = self._cfg.rule_weight * rule.reward + self._cfg.weight * verdict
    return env_api.Score(reward, {**rule.parts, "rule": rule.reward, "judge": verdict},
                         rule.outcome)
