"""Greedy evaluation on held-out prompts, with the learner's current params."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arl_jax.sampler import sampling


@dataclasses.dataclass(frozen=True)
class EvalResult:
  reward: float
  num_prompts: int
  examples: tuple[tuple[str, str], ...]  # (prompt, completion) for a glance


class Evaluator:
  """Compiles greedy prefill/decode once for a fixed eval set and reuses them."""

  def __init__(self, *, graphdef, env, tokenizer, prompts, mesh: Mesh, prompt_len: int,
               max_new_tokens: int):
    self._graphdef = graphdef
    self._env = env
    self._tokenizer = tokenizer
    self._prompts = list(prompts)
    self._max_new_tokens = max_new_tokens
    self._settings = sampling.SamplingSettings(greedy=True, eos_id=tokenizer.eos_id,
                                               pad_id=tokenizer.pad_id)
    # Pad the eval set to a multiple of the mesh size so rows split evenly.
    n = len(self._prompts)
    rows = -(-n // mesh.size) * mesh.size
    tokens = np.full((rows, prompt_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((rows, prompt_len), bool)
    for i, prompt in enumerate(self._prompts):
      ids = env.encode_prompt(prompt)
      tokens[i, prompt_len - len(ids):] = ids
      mask[i, prompt_len - len(ids):] = True
    replicated = NamedSharding(mesh, P())
    put = lambda x: jax.device_put(x, replicated)
    self._inputs = (put(tokens), put(mask), put(np.arange(rows) < n),
                    put(sampling.row_keys(0, np.arange(rows), np.zeros(rows))))
    self._prompt_len = prompt_len
    self._prefill = jax.jit(sampling.prefill, static_argnums=0,
                            static_argnames=("settings", "max_new_tokens"))
    self._decode = jax.jit(sampling.decode_step, static_argnums=0, static_argnames=("settings",),
                           donate_argnames=("state",))
    self._no_stop = put(np.zeros((rows,), bool))

  def __call__(self, params) -> EvalResult:
    tokens, mask, active, keys = self._inputs
    version = jnp.int32(0)  # versions are not recorded for evaluation
    state = self._prefill(self._graphdef, params, version, tokens, mask, active, keys,
                          settings=self._settings, max_new_tokens=self._max_new_tokens)
    for _ in range(self._max_new_tokens - 1):
      state = self._decode(self._graphdef, params, version, state, self._no_stop,
                           settings=self._settings)
    completions = np.asarray(jax.device_get(state.tokens))[:, self._prompt_len:]
    rewards = [self._env.score(p, completions[i]) for i, p in enumerate(self._prompts)]
    examples = tuple((p.text, self._tokenizer.decode(completions[i]))
                     for i, p in enumerate(self._prompts[:3]))
    return EvalResult(reward=float(np.mean(rewards)), num_prompts=len(rewards),
                      examples=examples)
