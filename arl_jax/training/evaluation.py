"""Held-out evaluation with the learner's current params: greedy, and sampled.

It samples through the engine's scheduler and runner (`sampler/generate.py`),
so evaluation measures exactly what the sampler would generate, pinned to
the params it is given. The greedy pass runs on the learner mesh with the
learner's params and takes a slot per prompt. The sampled pass (`samples` >
0) runs where it is told (`sampled_mesh`: a run gives it the sampler mesh and
the published params, `training/sampled_eval.py` runs it beside training)
and draws that many completions of each prompt at `temperature` in groups,
as many at once as the engine's slots hold (continuous batching); it reports
the unbiased pass@k and avg@n (`metrics/pass_at_k.py`) per environment. Its
draws are keyed by the run's seed, prompt and sample, so two evaluations of
the same params draw the same completions (common random numbers: a change
between evaluations is the policy's, not the dice).
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
import operator

import numpy as np
from jax.sharding import Mesh

from arl_jax.envs import env_api
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.metrics import pass_at_k as pass_at_k_lib
from arl_jax.sampler import engine_config, sampling
from arl_jax.sampler import generate as generate_lib

# Decode steps per device call while no episode waits (`EngineConfig.decode_burst`):
# what finished segments may overrun by, against one host sync per step.
_DECODE_BURST = 8
# Rows one insert prefills at most (`EngineConfig.max_insert_rows`), unless the
# run's sampler sets fewer: the greedy pass admits every prompt at once, and an
# insert of 200 of SmolLM2's prompts held 0.7 GiB of fresh keys and values.
_INSERT_ROWS = 32


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Attributes:
    reward: mean reward over the prompts (0 for an episode a fault ended).
    num_prompts: prompts evaluated.
    examples: (prompt, completion) of the first few prompts, for a glance.
    reward_by_env: mean reward per environment name.
    env_errors: environment faults per environment name, every environment
      of the evaluation set listed (0 included), both passes together.
    samples: sampled completions per prompt (0: no sampled pass).
    pass_at_k: the sampled pass's unbiased pass@k, `{k: mean over prompts}`.
    avg_at_n: the sampled pass's mean reward over every sample.
    sampled_by_env: per environment, `{"pass_at_k": {...}, "avg_at_n": ...}`.
  """

  reward: float
  num_prompts: int
  examples: tuple[tuple[str, str], ...]
  reward_by_env: dict[str, float] = dataclasses.field(default_factory=dict)
  env_errors: dict[str, int] = dataclasses.field(default_factory=dict)
  samples: int = 0
  pass_at_k: dict[int, float] = dataclasses.field(default_factory=dict)
  avg_at_n: float = 0.0
  sampled_by_env: dict[str, dict] = dataclasses.field(default_factory=dict)

  @property
  def num_env_errors(self) -> int:
    return sum(self.env_errors.values())


def greedy_engine_config(engine_cfg: engine_config.EngineConfig, num_prompts: int,
                         slots: int = 0) -> engine_config.EngineConfig:
  """The greedy pass's engine: a dense slot a prompt (at most `slots` at once,
  `eval_slots`: the rest wait for a free one), each context prefilled whole
  and on its own, as evaluation always did (a chunked or shared prefill may
  round differently, and greedy answers with it), at most `_INSERT_ROWS` an
  insert, padded to a power of two from 32 unless the run names prompt
  buckets (`engine_config.with_length_buckets`)."""
  return dataclasses.replace(
      engine_config.with_length_buckets(engine_cfg),
      num_slots=min(num_prompts, slots) if slots else num_prompts, group_size=1,
      weight_update="in_flight",
      kv_policy="keep", kv_cache="dense", kv_pages=0, kv_memory_fraction=0.0,
      paged_attention="xla", precompile=False,
      decode_burst=_DECODE_BURST, prefill_chunk=0, share_prompts=False,
      max_insert_rows=min(engine_cfg.max_insert_rows or _INSERT_ROWS, _INSERT_ROWS))


def sampled_engine_config(engine_cfg: engine_config.EngineConfig, num_prompts: int,
                          samples: int) -> engine_config.EngineConfig:
  """The sampled pass's engine: the greedy one's, in groups of `samples`, as
  many at once as the run's engine has slots for."""
  slots = max(engine_cfg.num_slots // samples, 1) * samples
  return dataclasses.replace(greedy_engine_config(engine_cfg, num_prompts),
                             num_slots=min(slots, samples * num_prompts), group_size=samples)


class Evaluator:
  """Compiles greedy (and sampled) generation once for a fixed eval set and
  reuses it."""

  def __init__(self, *, graphdef, model_cfg, env, tokenizer: tokenizer_lib.Tokenizer, prompts,
               mesh: Mesh,
               engine_cfg: engine_config.EngineConfig, samples: int = 0,
               temperature: float = 1.0, solved_reward: float = 1.0,
               sampled_mesh: Mesh | None = None, sampled_model_cfg=None, slots: int = 0):
    """Args:
      graphdef: decoder graph definition.
      model_cfg: the decoder's ModelConfig.
      env: the environment (without simulated latency: evaluation waits on it).
      tokenizer: decodes the examples.
      prompts: the evaluation prompt records.
      mesh: where to run (the learner mesh; slots are replicated over it).
      engine_cfg: the sampler's settings (prompt buckets, budget, multi-turn
        geometry, slots, seed); the greedy pass takes a dense slot per prompt.
      samples: sampled completions per prompt (0: greedy only).
      temperature: the sampled pass's temperature.
      solved_reward: a sample with at least this reward is solved (pass@k).
      sampled_mesh: where the sampled pass runs (default `mesh`); its params
        must be there.
      sampled_model_cfg: the model as the sampled pass runs it (the
        sampler's dtype; default `model_cfg`).
      slots: the greedy pass's slots (`eval_slots`; 0: one per prompt).
    """
    self._env = env
    self._tokenizer = tokenizer
    self._prompts = list(prompts)
    self._env_names = [env.env_name_of(p) for p in self._prompts]
    self._names = np.array(self._env_names)  # (a mask per environment: names == e)
    self._envs = sorted(set(self._env_names))
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
    cfg = greedy_engine_config(engine_cfg, len(self._prompts), slots)
    # Which stop tokens end each prompt's segments (they differ in a mixture).
    stop_ids_fn = lambda i: env_api.segment_stop_ids(tokenizer, env, self._prompts[i])  # noqa: E731
    self._generator = generate_lib.Generator(
        cfg=cfg, settings=settings, graphdef=graphdef, model_cfg=model_cfg, mesh=mesh,
        stop_ids_fn=stop_ids_fn)
    self._samples = samples
    self._solved_reward = solved_reward
    self._sampler = None
    if samples:
      self._sampler = generate_lib.Generator(
          cfg=sampled_engine_config(engine_cfg, len(self._prompts), samples),
          settings=dataclasses.replace(settings, greedy=False, temperature=float(temperature)),
          graphdef=graphdef, model_cfg=sampled_model_cfg or model_cfg,
          mesh=sampled_mesh or mesh, stop_ids_fn=stop_ids_fn)

  def declare_memory(self, ledger) -> None:
    """Tells a `memory_ledger.Ledger` what the passes hold (their slots'
    state: nothing between passes, `Generator.release`)."""
    ledger.hold("evaluation kv cache", self, lambda e: [
        g.runner.state for g in (e._generator, e._sampler) if g is not None])

  @property
  def samples(self) -> int:
    """Sampled completions per prompt (0: no sampled pass)."""
    return self._samples

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

  def _play(self, generator, params, errors: collections.Counter):
    """Every episode of `generator` played out and scored: `(rewards [prompts,
    samples], completions by prompt)`; a faulted episode scores 0."""
    faulted = set()

    def next_turn(episode) -> bool:
      """Whether the environment answers `episode`'s segment (then appended)."""
      i = episode.group_id
      room = self._budgets[i] - episode.length
      if not (self._multi_turn and episode.last_stopped and room > 0):
        return False
      observation, ok = self._env_call(errors, self._env.step, i, list(episode.completion_ids),
                                       self._to_observation)
      if not ok:
        faulted.add((i, episode.sample_index))
      if observation is None or len(observation) >= room:
        return False
      episode.add_observation(observation)
      return True

    try:
      groups = generator.episodes(params, self._prompt_ids, budgets=self._budgets,
                                  on_segment=next_turn)
    finally:  # (its cache is as large as the held-out set: not kept between passes)
      generator.release()
    rewards = np.zeros((len(groups), len(groups[0]) if groups else 0), np.float64)
    for i, group in enumerate(groups):
      for episode in group:
        if (i, episode.sample_index) in faulted:  # not scored, as in the env runner
          continue
        reward, _ = self._env_call(errors, self._env.score, i, list(episode.completion_ids),
                                   lambda value: env_api.to_score(value).reward)
        rewards[i, episode.sample_index] = 0.0 if reward is None else reward
    return rewards, [[e.completion_ids for e in group] for group in groups]

  def greedy(self, params) -> EvalResult:
    """The greedy pass over `params` (on the learner mesh)."""
    errors = collections.Counter()
    rewards, completions = self._play(self._generator, params, errors)
    rewards = rewards[:, 0]
    examples = tuple((p.text, self._tokenizer.decode(c[0]))
                     for p, c in zip(self._prompts[:3], completions[:3]))
    names, envs = self._names, self._envs
    return EvalResult(reward=float(np.mean(rewards)), num_prompts=len(rewards),
                      examples=examples,
                      reward_by_env={e: float(np.mean(rewards[names == e])) for e in envs},
                      env_errors={e: errors[e] for e in envs})

  def sampled(self, params) -> dict:
    """The sampled pass over `params` (on `sampled_mesh`): `samples`,
    `pass_at_k`, `avg_at_n`, `sampled_by_env` (as `EvalResult`'s) and its own
    `env_errors`."""
    if self._sampler is None:
      raise ValueError("this Evaluator has no sampled pass (samples=0)")
    errors = collections.Counter()
    rewards, _ = self._play(self._sampler, params, errors)
    solved = rewards >= self._solved_reward
    names, envs = self._names, self._envs
    overall = pass_at_k_lib.summarise(solved, rewards)
    return dict(samples=self._samples, pass_at_k=overall["pass_at_k"],
                avg_at_n=overall["avg_at_n"],
                sampled_by_env={e: pass_at_k_lib.summarise(solved[names == e], rewards[names == e])
                                for e in envs},
                env_errors={e: errors[e] for e in envs})

  def __call__(self, params) -> EvalResult:
    """Both passes over `params`, one after the other (with `sampled_mesh`
    left at `mesh`); `env_errors` counts both passes' faults."""
    result = self.greedy(params)
    if self._sampler is None:
      return result
    sampled = self.sampled(params)
    errors = sampled.pop("env_errors")
    return dataclasses.replace(
        result, env_errors={e: n + errors[e] for e, n in result.env_errors.items()}, **sampled)

