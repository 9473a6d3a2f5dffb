"""Greedy evaluation on held-out prompts, with the learner's current params.

It runs the sampler's own slot functions (`slot_fns.make_sampler_fns`) on the
learner mesh, so evaluation measures exactly what the sampler would generate
greedily, without waiting for a publish. Multi-turn environments are played
turn by turn: all episodes sample a segment together, the environment answers,
and the still-running episodes are re-prefilled with their whole context, as
the engine re-admits them.

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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from arl_jax import rows as rows_lib
from arl_jax.envs import env_api
from arl_jax.sampler import engine_config, insert_batch, sampling, slot_fns, token_draw

# Decode steps between two checks whether every episode's segment has ended.
_DONE_CHECK_EVERY = 8


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
  """Compiles greedy insert/decode once for a fixed eval set and reuses them."""

  def __init__(self, *, graphdef, model_cfg, env, tokenizer, prompts, mesh: Mesh,
               engine_cfg: engine_config.EngineConfig):
    """Args:
      graphdef: decoder graph definition.
      model_cfg: the decoder's ModelConfig.
      env: the environment (without simulated latency: evaluation waits on it).
      tokenizer: decodes the examples.
      prompts: the evaluation prompt records.
      mesh: where to run (the learner mesh; slots are replicated over it).
      engine_cfg: prompt buckets, budget and multi-turn geometry (as the sampler's).
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
    rows = len(self._prompts)  # one slot per prompt
    self._slots = np.arange(rows, dtype=np.int32)
    self._keys = np.asarray(token_draw.row_keys(0, np.arange(rows), np.zeros(rows)))
    self._no_stop = np.zeros((rows,), bool)
    settings = sampling.SamplingSettings(
        greedy=True, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
        stop_ids=env_api.sampler_stop_ids(tokenizer, env))
    # Which stop tokens end each prompt's segments (they differ in a mixture).
    self._stop_mask = np.array(
        [insert_batch.stop_mask_row(settings, env_api.segment_stop_ids(tokenizer, env, p))
         for p in self._prompts], bool).reshape(rows, len(settings.stop_ids))
    self._fns = slot_fns.make_sampler_fns(
        graphdef=graphdef, model_cfg=model_cfg, mesh=mesh, settings=settings, num_slots=rows,
        length=engine_cfg.length)

  def _play_segment(self, params, state, contexts: dict[int, list[int]], budgets: dict[int, int],
                    buckets: tuple[int, ...]):
    """Samples one segment in each given slot, contexts bucketed as the engine
    buckets them; returns the state and the host rows of every slot."""
    version = jnp.int32(0)  # versions are not recorded for evaluation
    by_bucket = {}
    for i, ids in contexts.items():
      by_bucket.setdefault(next(b for b in buckets if b >= len(ids)), []).append(i)
    for bucket, rows in by_bucket.items():
      r = engine_config.row_bucket(len(rows), len(self._prompts))
      rows = rows + [rows[-1]] * (r - len(rows))  # duplicates rewrite the same slot
      tokens, mask = rows_lib.left_pad([contexts[i] for i in rows], bucket,
                                       self._tokenizer.pad_id)
      state = self._fns.insert(params, version, state, np.asarray(rows, np.int32), tokens, mask,
                               self._keys[rows], np.asarray([budgets[i] for i in rows], np.int32),
                               self._stop_mask[rows])
    live = np.zeros((len(self._prompts),), bool)
    live[list(contexts)] = True
    for step in range(max(budgets.values()) - 1):
      if step % _DONE_CHECK_EVERY == 0 and bool(jnp.all(state.done)):
        break
      state = self._fns.decode(params, version, state, self._no_stop, live)
    host = jax.device_get(self._fns.take_rows(state, self._slots))
    return state, host

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
    default = self._cfg.max_new_tokens
    n_max = [min(default, self._env.max_new_tokens_for(p) or default) for p in self._prompts]
    completions = [[] for _ in self._prompts]
    errors = collections.Counter()
    faulted = [False] * len(self._prompts)
    active = list(range(len(self._prompts)))
    state = self._fns.init()
    buckets = self._cfg.prompt_buckets
    while active:
      contexts = {i: [*self._prompt_ids[i], *completions[i]] for i in active}
      budgets = {i: n_max[i] - len(completions[i]) for i in active}
      state, host = self._play_segment(params, state, contexts, budgets, buckets)
      still = []
      for i in active:
        start = int(host["prompt_end"][i])
        n = int(host["token_mask"][i, start:].sum())
        completions[i].extend(int(t) for t in host["tokens"][i, start:start + n])
        room = n_max[i] - len(completions[i])
        if not (self._multi_turn and host["stopped"][i] and room > 0):
          continue
        observation, ok = self._env_call(errors, self._env.step, i, list(completions[i]),
                                         self._to_observation)
        faulted[i] = not ok
        if observation is not None and len(observation) < room:
          completions[i].extend(int(t) for t in observation)
          still.append(i)
      active = still
      buckets = self._cfg.continuation_buckets
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
