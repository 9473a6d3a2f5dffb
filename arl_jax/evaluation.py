"""Greedy evaluation on held-out prompts, with the learner's current params.

It runs the sampler's own prefill/decode functions (`engine.make_sampler_fns`)
on the learner mesh, so evaluation measures exactly what the sampler would
generate greedily, without waiting for a publish.
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
  """Compiles greedy prefill/decode once for a fixed eval set and reuses them."""

  def __init__(self, *, graphdef, params_like, env, tokenizer, prompts, mesh: Mesh,
               prompt_len: int, max_new_tokens: int):
    self._env = env
    self._tokenizer = tokenizer
    self._prompts = list(prompts)
    self._max_new_tokens = max_new_tokens
    self._prompt_len = prompt_len
    # Rows are replicated over the learner mesh (it has no `data` axis).
    rows = len(self._prompts)
    tokens = np.full((rows, prompt_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((rows, prompt_len), bool)
    for i, prompt in enumerate(self._prompts):
      ids = env.encode_prompt(prompt)
      tokens[i, prompt_len - len(ids):] = ids
      mask[i, prompt_len - len(ids):] = True
    self._inputs = (tokens, mask, np.ones((rows,), bool),
                    np.asarray(sampling.row_keys(0, np.arange(rows), np.zeros(rows))))
    self._no_stop = np.zeros((rows,), bool)
    settings = sampling.SamplingSettings(greedy=True, eos_id=tokenizer.eos_id,
                                         pad_id=tokenizer.pad_id)
    self._prefill_fn, self._decode_fn = engine_lib.make_sampler_fns(
        graphdef=graphdef, params_like=params_like, mesh=mesh, settings=settings,
        num_slots=rows, prompt_len=prompt_len, max_new_tokens=max_new_tokens)

  def __call__(self, params) -> EvalResult:
    version = jnp.int32(0)  # versions are not recorded for evaluation
    state = self._prefill_fn(params, version, *self._inputs)
    for _ in range(self._max_new_tokens - 1):
      state = self._decode_fn(params, version, state, self._no_stop)
    completions = np.asarray(jax.device_get(state.tokens))[:, self._prompt_len:]
    rewards = [self._env.score(p, completions[i]) for i, p in enumerate(self._prompts)]
    examples = tuple((p.text, self._tokenizer.decode(completions[i]))
                     for i, p in enumerate(self._prompts[:3]))
    return EvalResult(reward=float(np.mean(rewards)), num_prompts=len(rewards),
                      examples=examples)
