"""Pure prefill and decode-step functions of the sampler (no threads, no state).

The engine (`engine.py`) jits these with params passed as an argument, so that
a newly published version is picked up between two decode steps without
recompiling. Every sampled token records the log-probability it was sampled
with and the version of the params that produced its logits: a decode step
first runs the model under the params it is given, then samples from those
logits, so the recorded version is exactly the one behind the probability.

Shapes: B slots, P prompt bucket, N max new tokens, L = P + N = cache length.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from arl_jax.models import decoder as decoder_lib
from arl_jax.models import kv_cache as kv_cache_lib

# Version recorded for positions that were not sampled (prompt, padding).
NO_VERSION = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSettings:
  """Static sampling settings (hashable: a jit static argument).

  Attributes:
    temperature: softmax temperature; the behaviour log-prob is that of the
      tempered distribution, and the learner uses the same temperature.
    greedy: argmax decoding (evaluation); log-probs are then untempered.
    eos_id: token that ends a completion (kept, and trained on).
    pad_id: filler for positions after the end.
  """

  temperature: float = 1.0
  greedy: bool = False
  eos_id: int
  pad_id: int


@flax.struct.dataclass
class DecodeState:
  """Everything a wave of slots carries between decode steps.

  Attributes:
    tokens: `[B, L]` int32, left-padded prompt in `[:, :P]`, completion after.
    token_mask: `[B, L]` bool, real tokens (prompt and sampled, EOS included).
    logprobs: `[B, L]` float32 behaviour log-prob of sampled tokens, else 0.
    versions: `[B, L]` int32 policy version of sampled tokens, else -1.
    cache: the KV cache, length L.
    positions: `[B]` int32 RoPE position of the last sampled token.
    index: `[]` int32 column of the last sampled token (same for all slots).
    done: `[B]` bool, slot finished (EOS, length, cancelled or never used).
    stopped: `[B]` bool, slot finished by sampling EOS.
    keys: `[B, 2]` uint32 per-slot PRNG keys (fold_in with the column index).
  """

  tokens: jax.Array
  token_mask: jax.Array
  logprobs: jax.Array
  versions: jax.Array
  cache: kv_cache_lib.KVCache
  positions: jax.Array
  index: jax.Array
  done: jax.Array
  stopped: jax.Array
  keys: jax.Array


def sample_from_logits(logits, keys, index, settings: SamplingSettings):
  """Draws one token per row and returns it with its log-probability.

  Inverse-CDF sampling: one uniform per row against the cumulative softmax.
  `jax.random.categorical` draws B x V Gumbel noises, which cost half a model
  forward at a 32k vocabulary on CPU (JAX_NOTES.md); the distribution and the
  recorded log-prob are the same.

  Args:
    logits: `[B, V]` float32.
    keys: `[B, 2]` uint32 per-row keys.
    index: `[]` int32 column being sampled, folded into the keys so that the
      draw depends only on (row key, column), not on batching or timing.
    settings: static sampling settings.

  Returns:
    `(tokens [B] int32, logprobs [B] float32)`.
  """
  if settings.greedy:
    logp = jax.nn.log_softmax(logits, axis=-1)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    # log_softmax in float32 (logits are float32 already): the recorded
    # behaviour log-prob is the denominator of every importance ratio.
    logp = jax.nn.log_softmax(logits / settings.temperature, axis=-1)
    # 1 - U lies in (0, 1]: a draw of exactly 0 would pick token 0 even when
    # its probability is 0, and record a log-prob of -inf.
    uniforms = 1.0 - jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, index)))(keys)
    cdf = jnp.cumsum(jnp.exp(logp), axis=-1)
    tokens = jnp.sum(cdf < uniforms[:, None] * cdf[:, -1:], axis=-1).astype(jnp.int32)
    tokens = jnp.minimum(tokens, logits.shape[-1] - 1)
  token_logp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  return tokens, token_logp


def _record(state: DecodeState, column, tokens, logp, version, settings, max_index):
  """Writes freshly sampled tokens at `column` for live slots and updates `done`."""
  live = ~state.done
  tokens = jnp.where(live, tokens, settings.pad_id)
  set_col = lambda arr, val: arr.at[:, column].set(val)
  is_eos = live & (tokens == settings.eos_id)
  return state.replace(
      tokens=set_col(state.tokens, tokens),
      token_mask=set_col(state.token_mask, live),
      logprobs=set_col(state.logprobs, jnp.where(live, logp, 0.0)),
      versions=set_col(state.versions, jnp.where(live, version, NO_VERSION)),
      index=column,
      done=state.done | is_eos | (column >= max_index),
      stopped=state.stopped | is_eos,
  )


def prefill(graphdef, params, version, prompt_tokens, prompt_mask, active, keys, *,
            settings: SamplingSettings, max_new_tokens: int) -> DecodeState:
  """Runs the prompts through the model and samples the first completion token.

  Args:
    graphdef: nnx graph definition of the decoder (static).
    params: nnx.State of the decoder params (an argument, never closed over).
    version: `[]` int32 policy version of `params`.
    prompt_tokens: `[B, P]` int32, left-padded.
    prompt_mask: `[B, P]` bool, True on real prompt tokens.
    active: `[B]` bool, False for unused slots (they start done).
    keys: `[B, 2]` uint32 per-slot keys.
    settings: static sampling settings.
    max_new_tokens: N, static.

  Returns:
    The DecodeState after sampling column P.
  """
  model = nnx.merge(graphdef, params)
  b, p = prompt_tokens.shape
  length = p + max_new_tokens
  cfg = model.cfg
  cache = kv_cache_lib.KVCache.zeros(
      batch=b, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, length=length,
      head_dim=cfg.head_dim, dtype=jnp.dtype(cfg.param_dtype))
  zero_index = jnp.zeros((b,), jnp.int32)
  cache = cache.replace(valid=kv_cache_lib.write_valid(cache.valid, prompt_mask, zero_index))
  positions = decoder_lib.positions_from_mask(prompt_mask)
  key_ids = jnp.arange(length)
  attn_mask = cache.valid[:, None, :] & (key_ids[None, None, :] <= jnp.arange(p)[None, :, None])
  logits, cache = model(prompt_tokens, positions, attn_mask, cache, zero_index)
  pad_tail = lambda fill, dtype: jnp.full((b, max_new_tokens), fill, dtype)
  state = DecodeState(
      tokens=jnp.concatenate([prompt_tokens, pad_tail(settings.pad_id, jnp.int32)], axis=1),
      token_mask=jnp.concatenate([prompt_mask, pad_tail(False, jnp.bool_)], axis=1),
      logprobs=jnp.zeros((b, length), jnp.float32),
      versions=jnp.full((b, length), NO_VERSION, jnp.int32),
      cache=cache,
      positions=jnp.sum(prompt_mask, axis=1).astype(jnp.int32),
      index=jnp.int32(p - 1),
      done=~active,
      stopped=jnp.zeros((b,), jnp.bool_),
      keys=keys,
  )
  column = jnp.int32(p)
  tokens, logp = sample_from_logits(logits[:, -1], keys, column, settings)
  return _record(state, column, tokens, logp, version, settings, length - 1)


def decode_step(graphdef, params, version, state: DecodeState, stop_rows, *,
                settings: SamplingSettings) -> DecodeState:
  """Feeds the last sampled token and samples the next one.

  Args:
    graphdef: nnx graph definition (static).
    params: decoder params now live in the sampler.
    version: `[]` int32 version of `params`; recorded on the new tokens.
    state: DecodeState of the wave.
    stop_rows: `[B]` bool, slots to end before this step (cancelled groups).
    settings: static sampling settings.

  Returns:
    The DecodeState with one more column sampled.
  """
  model = nnx.merge(graphdef, params)
  state = state.replace(done=state.done | stop_rows)
  last = state.index
  b, length = state.tokens.shape
  last_tokens = jax.lax.dynamic_slice_in_dim(state.tokens, last, 1, axis=1)  # [B, 1]
  last_index = jnp.full((b,), last, jnp.int32)
  live = ~state.done
  cache = state.cache.replace(
      valid=kv_cache_lib.write_valid(state.cache.valid, live[:, None], last_index))
  attn_mask = cache.valid[:, None, :] & (jnp.arange(length)[None, None, :] <= last)
  logits, cache = model(last_tokens, state.positions[:, None], attn_mask, cache, last_index)
  state = state.replace(cache=cache, positions=state.positions + live.astype(jnp.int32))
  tokens, logp = sample_from_logits(logits[:, 0], state.keys, last + 1, settings)
  return _record(state, last + 1, tokens, logp, version, settings, length - 1)


def row_keys(seed: int, group_ids, sample_indices):
  """Per-rollout PRNG keys `[B, 2]`: a function of (seed, group id, sample index) only.

  Keeping draws independent of slot assignment and batching lets the
  asynchronous pipeline and the synchronous reference sample identical tokens.
  """
  base = jax.random.PRNGKey(seed)
  fold = lambda g, s: jax.random.fold_in(jax.random.fold_in(base, g), s)
  return jax.vmap(fold)(jnp.asarray(group_ids, jnp.uint32), jnp.asarray(sample_indices, jnp.uint32))
