"""Greedy evaluation on held-out prompts, with the learner's current params.

It samples through the engine's scheduler and runner (`sampler/generate.py`)
on the learner mesh, a slot per prompt, so evaluation measures exactly what
the sampler would generate greedily, without waiting for a publish.
Multi-turn environments are played as the run plays them: when a segment
ends on a stop token with budget left, the environment answers and the
episode is re-admitted with its whole context while the others decode.

Environment faults are counted, not hidden: a `step` or `score` that raises
or answers something malformed (a non-finite reward, an observation id
outside the vocabulary) ends that episode with reward 0, as in the env runner,
and `EvalResult.env_errors` counts it per environment.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator

import numpy as np
from jax.sharding import Mesh

from arl_jax.envs import env_api
from arl_jax.sampler import engine_config, sampling
from arl_jax.sampler import generate as generate_lib

# Decode steps per device call while no episode waits (`EngineConfig.decode_burst`):
# what finished segments may overrun by, against one host sync per step.
_DECODE_BURST = 8


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Attributes:
    reward: mean reward over the prompts (0 for an episode a fault ended).
    num_prompts: prompts evaluated.
    examples: (prompt, completion) of the first few prompts, for a glance.
    reward_by_env: mean reward per environment name.
    env_errors: environment faults per environment name, every environment
      of the evaluation set listed (0 included).
  """

  reward: float
  num_prompts: int
  examples: tuple[tuple[str, str], ...]
  reward_by_env: dict[str, float] = dataclasses.field(default_factory=dict)
  env_errors: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def num_env_errors(self) -> int:
    return sum(self.env_errors.values())


class Evaluator:
  """Compiles greedy sampling once for a fixed eval set and reuses it."""

  def __init__(self, *, graphdef, model_cfg, env, tokenizer, prompts, mesh: Mesh,
               engine_cfg: engine_config.EngineConfig):
    """Args:
      graphdef: decoder graph definition.
      model_cfg: the decoder's ModelConfig.
      env: the environment (without simulated latency: evaluation waits on it).
      tokenizer: decodes the examples.
      prompts: the evaluation prompt records.
      mesh: where to run (the learner mesh; slots are replicated over it).
      engine_cfg: the sampler's settings (prompt buckets, budget, multi-turn
        geometry); evaluation takes a dense slot per prompt, one sample each.
    """
    self._env = env
    self._tokenizer = tokenizer
    self._prompts = list(prompts)
    self._env_names = [env.env_name_of(p) for p in self._prompts]
    self._vocab_size = model_cfg.vocab_size
    self._cfg = engine_cfg
    self._multi_turn = env.multi_turn
    if self._multi_turn and not engine_cfg.multi_turn:
      raise ValueError(f"env {env.name!r} is multi-turn but engine_cfg.multi_turn is False")
    self._prompt_ids = [env.encode_prompt(p) for p in self._prompts]
    default = engine_cfg.max_new_tokens
    self._budgets = [min(default, env.max_new_tokens_for(p) or default) for p in self._prompts]
    settings = sampling.SamplingSettings(
        greedy=True, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
        stop_ids=env_api.sampler_stop_ids(tokenizer, env))
    # Each context prefilled whole and on its own, as evaluation always did (a
    # chunked or shared prefill may round differently, and greedy answers with it).
    cfg = dataclasses.replace(
        engine_cfg, num_slots=len(self._prompts), group_size=1, weight_update="in_flight",
        kv_policy="keep", kv_cache="dense", kv_pages=0, kv_memory_fraction=0.0,
        paged_attention="xla", precompile=False,
        decode_burst=_DECODE_BURST, prefill_chunk=0, share_prompts=False)
    self._generator = generate_lib.Generator(
        cfg=cfg, settings=settings, graphdef=graphdef, model_cfg=model_cfg, mesh=mesh,
        # Which stop tokens end each prompt's segments (they differ in a mixture).
        stop_ids_fn=lambda i: env_api.segment_stop_ids(tokenizer, env, self._prompts[i]))

  def _env_call(self, errors: collections.Counter, fn, i: int, completion: list[int],
                convert_fn):
    """`(convert_fn(fn(prompt_i, completion)), True)`, or `(None, False)` after
    counting an environment fault of prompt i's environment in `errors`."""
    try:
      return convert_fn(fn(self._prompts[i], completion)), True
    except Exception:  # noqa: BLE001 - an environment fault is data, not a crash
      errors[self._env_names[i]] += 1
      return None, False

  def _to_observation(self, value) -> list[int] | None:
    if value is None:
      return None
    tokens = [operator.index(t) for t in value]  # ints only (no floats, no strings)
    # An id outside the embedding table would be silently clamped by the
    # model's gather: a fault instead, as in the env runner.
    bad = [t for t in tokens if t < 0 or t >= self._vocab_size]
    if bad:
      raise ValueError(f"observation ids {bad} are outside the vocabulary "
                       f"[0, {self._vocab_size})")
    return tokens

  def __call__(self, params) -> EvalResult:
    errors = collections.Counter()
    faulted = [False] * len(self._prompts)

    def next_turn(episode) -> bool:
      """Whether the environment answers `episode`'s segment (then appended)."""
      i = episode.group_id
      room = self._budgets[i] - episode.length
      if not (self._multi_turn and episode.last_stopped and room > 0):
        return False
      observation, ok = self._env_call(errors, self._env.step, i, list(episode.completion_ids),
                                       self._to_observation)
      faulted[i] = not ok
      if observation is None or len(observation) >= room:
        return False
      episode.add_observation(observation)
      return True

    episodes = self._generator.episodes(params, self._prompt_ids, budgets=self._budgets,
                                        on_segment=next_turn)
    completions = [group[0].completion_ids for group in episodes]
    rewards = []
    for i, completion in enumerate(completions):
      reward = None
      if not faulted[i]:  # an episode a fault ended is not scored, as in the env runner
        reward, _ = self._env_call(errors, self._env.score, i, list(completion), _to_reward)
      rewards.append(0.0 if reward is None else reward)
    examples = tuple((p.text, self._tokenizer.decode(c))
                     for p, c in zip(self._prompts[:3], completions[:3]))
    by_env = collections.defaultdict(list)
    for name, r in zip(self._env_names, rewards):
      by_env[name].append(r)
    return EvalResult(reward=float(np.mean(rewards)), num_prompts=len(rewards),
                      examples=examples,
                      reward_by_env={k: float(np.mean(v)) for k, v in sorted(by_env.items())},
                      env_errors={k: errors[k] for k in sorted(by_env)})


def _to_reward(value) -> float:
  reward = float(value)
  if not math.isfinite(reward):
    raise ValueError(f"reward {reward} is not finite")
  return reward
