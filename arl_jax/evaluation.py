"""Greedy evaluation on held-out prompts, with the learner's current params.

It runs the sampler's own slot functions (`engine.make_sampler_fns`) on the
learner mesh, so evaluation measures exactly what the sampler would generate
greedily, without waiting for a publish.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import sampling


@dataclasses.dataclass(frozen=True)
class EvalResult:
  reward: float
  num_prompts: int
  examples: tuple[tuple[str, str], ...]  # (prompt, completion) for a glance


class Evaluator:
  """Compiles greedy insert/decode once for a fixed eval set and reuses them."""

  def __init__(self, *, graphdef, model_cfg, env, tokenizer, prompts, mesh: Mesh,
               prompt_len: int, max_new_tokens: int):
    self._env = env
    self._tokenizer = tokenizer
    self._prompts = list(prompts)
    self._max_new_tokens = max_new_tokens
    rows = len(self._prompts)  # one slot per prompt, replicated over the learner mesh
    tokens = np.full((rows, prompt_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((rows, prompt_len), bool)
    for i, prompt in enumerate(self._prompts):
      ids = env.encode_prompt(prompt)
      tokens[i, prompt_len - len(ids):] = ids
      mask[i, prompt_len - len(ids):] = True
    self._prompt_len = prompt_len
    self._inputs = (np.arange(rows, dtype=np.int32), tokens, mask,
                    np.asarray(sampling.row_keys(0, np.arange(rows), np.zeros(rows))),
                    np.full((rows,), max_new_tokens, np.int32))
    self._all_rows = np.ones((rows,), bool)
    self._no_stop = np.zeros((rows,), bool)
    settings = sampling.SamplingSettings(greedy=True, eos_id=tokenizer.eos_id,
                                         pad_id=tokenizer.pad_id)
    self._fns = engine_lib.make_sampler_fns(
        graphdef=graphdef, model_cfg=model_cfg, mesh=mesh, settings=settings, num_slots=rows,
        length=prompt_len + max_new_tokens)

  def __call__(self, params) -> EvalResult:
    version = jnp.int32(0)  # versions are not recorded for evaluation
    state = self._fns.insert(params, version, self._fns.init(), *self._inputs)
    for _ in range(self._max_new_tokens - 1):
      state = self._fns.decode(params, version, state, self._no_stop, self._all_rows)
    completions = np.asarray(jax.device_get(state.tokens))[:, self._prompt_len:]
    rewards = [self._env.score(p, completions[i]) for i, p in enumerate(self._prompts)]
    examples = tuple((p.text, self._tokenizer.decode(completions[i]))
                     for i, p in enumerate(self._prompts[:3]))
    return EvalResult(reward=float(np.mean(rewards)), num_prompts=len(rewards),
                      examples=examples)
