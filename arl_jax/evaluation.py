"""Greedy evaluation on held-out prompts, with the learner's current params.

It runs the sampler's own slot functions (`engine.make_sampler_fns`) on the
learner mesh, so evaluation measures exactly what the sampler would generate
greedily, without waiting for a publish. Multi-turn environments are played
turn by turn: all episodes sample a segment together, the environment answers,
and the still-running episodes are re-prefilled with their whole context, as
the engine re-admits them.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from arl_jax.envs import env_api
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import sampling

# Decode steps between two checks whether every episode's segment has ended.
_DONE_CHECK_EVERY = 8


@dataclasses.dataclass(frozen=True)
class EvalResult:
  reward: float
  num_prompts: int
  examples: tuple[tuple[str, str], ...]  # (prompt, completion) for a glance
  reward_by_env: dict[str, float] = dataclasses.field(default_factory=dict)


class Evaluator:
  """Compiles greedy insert/decode once for a fixed eval set and reuses them."""

  def __init__(self, *, graphdef, model_cfg, env, tokenizer, prompts, mesh: Mesh,
               engine_cfg: engine_lib.EngineConfig):
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
    self._cfg = engine_cfg
    self._multi_turn = env_api.is_multi_turn(env)
    if self._multi_turn and not engine_cfg.multi_turn:
      raise ValueError(f"env {env.name!r} is multi-turn but engine_cfg.multi_turn is False")
    self._prompt_ids = [env.encode_prompt(p) for p in self._prompts]
    rows = len(self._prompts)  # one slot per prompt
    self._slots = np.arange(rows, dtype=np.int32)
    self._keys = np.asarray(sampling.row_keys(0, np.arange(rows), np.zeros(rows)))
    self._no_stop = np.zeros((rows,), bool)
    settings = sampling.SamplingSettings(
        greedy=True, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
        stop_ids=env_api.sampler_stop_ids(tokenizer, env))
    # Which stop tokens end each prompt's segments (they differ in a mixture).
    self._stop_mask = np.array(
        [sampling.stop_mask_row(settings, env_api.segment_stop_ids(tokenizer, env, p))
         for p in self._prompts], bool).reshape(rows, len(settings.stop_ids))
    self._fns = engine_lib.make_sampler_fns(
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
      r = engine_lib.row_bucket(len(rows), len(self._prompts))
      rows = rows + [rows[-1]] * (r - len(rows))  # duplicates rewrite the same slot
      tokens = np.full((r, bucket), self._tokenizer.pad_id, np.int32)
      mask = np.zeros((r, bucket), bool)
      for j, i in enumerate(rows):
        tokens[j, bucket - len(contexts[i]):] = contexts[i]
        mask[j, bucket - len(contexts[i]):] = True
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

  @staticmethod
  def _safe(fn, *args):
    """An environment fault ends the episode with reward 0, as in the env runner."""
    try:
      return fn(*args)
    except Exception:  # noqa: BLE001 - an environment fault is data, not a crash
      return None

  def __call__(self, params) -> EvalResult:
    default = self._cfg.max_new_tokens
    n_max = [min(default, env_api.budget_of(self._env, p) or default) for p in self._prompts]
    completions = [[] for _ in self._prompts]
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
        observation = self._safe(self._env.step, self._prompts[i], list(completions[i]))
        if observation is not None and len(observation) < room:
          completions[i].extend(int(t) for t in observation)
          still.append(i)
      active = still
      buckets = self._cfg.continuation_buckets
    rewards = [self._safe(self._env.score, p, c) or 0.0
               for p, c in zip(self._prompts, completions)]
    examples = tuple((p.text, self._tokenizer.decode(c))
                     for p, c in zip(self._prompts[:3], completions[:3]))
    by_env = collections.defaultdict(list)
    for p, r in zip(self._prompts, rewards):
      by_env[env_api.env_name_of(self._env, p)].append(r)
    return EvalResult(reward=float(np.mean(rewards)), num_prompts=len(rewards),
                      examples=examples,
                      reward_by_env={k: float(np.mean(v)) for k, v in sorted(by_env.items())})
