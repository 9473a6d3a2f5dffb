"""Learner-side token log-probabilities, from the same model function as the sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from arl_jax.models import decoder as decoder_lib


def token_logprobs_and_entropy(graphdef, params, tokens, token_mask, temperature: float,
                               with_values: bool = False):
  """Log-probability of every token given its prefix, plus the policy entropy
  (and the critic's values with `with_values`).

  Args:
    graphdef: nnx graph definition of the decoder.
    params: decoder params (nnx.State).
    tokens: `[B, L]` int32, left-padded prompt followed by the completion.
    token_mask: `[B, L]` bool, real tokens.
    temperature: the sampler's temperature, so that at zero lag the ratio is 1.
    with_values: also return `values [B, L]`, column t holding V of the state
      before `tokens[:, t]` is sampled (from the hidden state at t - 1).

  Returns:
    `(logprobs [B, L], entropy [B, L])` (+ `values`), float32; column t scores
    `tokens[:, t]` given `tokens[:, :t]`, column 0 is 0.
  """
  model = nnx.merge(graphdef, params)
  positions = decoder_lib.positions_from_mask(token_mask)
  out = model(tokens, positions, decoder_lib.causal_mask(token_mask), with_values=with_values)
  logits = out[0]
  # log_softmax in float32 (the model returns float32 logits) so that sampler
  # and learner agree to ~1e-6 per token rather than ~1e-2 in bfloat16.
  logp_all = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
  picked = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  zeros = jnp.zeros_like(picked[:, :1])
  result = (jnp.concatenate([zeros, picked], axis=1), jnp.concatenate([zeros, entropy], axis=1))
  if with_values:
    result += (jnp.concatenate([zeros, out[2][:, :-1]], axis=1),)
  return result
