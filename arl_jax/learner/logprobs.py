"""Learner-side token log-probabilities, from the same model function as the sampler.

At a real vocabulary the float32 logits dominate the learner's memory: one
16k-token row of a 151,936-token vocabulary is ~10 GB of logits, and their
log-softmax as much again. With `chunk` set, the decoder returns its final
hidden states and the log-probs and entropy are computed `chunk` tokens at a
time (a `lax.map` whose body is rematerialised on the backward pass), so at
most `[chunk, V]` float32 logits exist at once, forward or backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from arl_jax.models import decoder as decoder_lib
from arl_jax.models import segment_attention as segment_attention_lib


def token_logprobs_and_entropy(graphdef, params, tokens, segment_ids, positions,
                               temperature: float, with_values: bool = False, chunk: int = 0,
                               attention_chunk: int = 0, remat: str = "none",
                               attention: str = "xla", scan_layers: bool = False,
                               mesh=None):
  """Log-probability of every token given its prefix, plus the policy entropy
  (and the critic's values with `with_values`).

  Args:
    graphdef: nnx graph definition of the decoder.
    params: decoder params (nnx.State).
    tokens: `[B, L]` int32, rows of sequences (a TrainBatch's).
    segment_ids: `[B, L]` int32, 0 on padding, k on a row's k-th sequence:
      a token sees only the earlier tokens of its own sequence.
    positions: `[B, L]` int32 RoPE positions (from 0 in each sequence).
    temperature: the sampler's temperature, so that at zero lag the ratio is 1.
    with_values: also return `values [B, L]`, column t holding V of the state
      before `tokens[:, t]` is sampled (from the hidden state at t - 1).
    chunk: static, tokens whose logits are computed at once (0: all of them).
    attention_chunk: static, queries whose attention scores exist at once
      (0: a whole row's; `models/segment_attention.py`).
    remat: static, what the backward pass keeps of each decoder block
      (`decoder.REMAT_POLICIES`).
    attention: static, the attention kernel (`segment_attention.KERNELS`).
    scan_layers: static, run the decoder's blocks as one `lax.scan`
      (`Decoder.__call__`): the same numbers, a block's scratch planned once.
    mesh: the mesh the rows are sharded on; an attention kernel then runs
      per device (`segment_attention.Segments`).

  Returns:
    `(logprobs [B, L], entropy [B, L])` (+ `values`), float32; column t scores
    `tokens[:, t]` given the tokens of its sequence before it, column 0 is 0.
    A sequence's first column is scored from the column before it, which is
    not its own: prompt tokens, never trained.
  """
  model = nnx.merge(graphdef, params)
  out = model(tokens, positions, segment_attention_lib.Segments(segment_ids, attention_chunk,
                                                                 attention, mesh),
              with_values=with_values, hidden_only=chunk > 0, remat=remat,
              scan_layers=scan_layers)
  if chunk:
    picked, entropy = _chunked_scores(out[0][:, :-1], model.head_weight(), tokens[:, 1:],
                                      temperature, chunk)
  else:
    picked, entropy = _scores(out[0][:, :-1], tokens[:, 1:], temperature)
  zeros = jnp.zeros_like(picked[:, :1])
  result = (jnp.concatenate([zeros, picked], axis=1), jnp.concatenate([zeros, entropy], axis=1))
  if with_values:
    result += (jnp.concatenate([zeros, out[2][:, :-1]], axis=1),)
  return result


def _scores(logits, targets, temperature: float):
  """`(log-prob of each target, entropy)` of `logits` `[..., V]` float32."""
  # log_softmax in float32 (the logits are float32) so that sampler and
  # learner agree to ~1e-6 per token rather than ~1e-2 in bfloat16.
  logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)
  picked = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
  return picked, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def _chunked_scores(hidden, head, targets, temperature: float, chunk: int):
  """`_scores` of `head_logits(hidden, head)` (`hidden` `[B, T, D]`), `chunk`
  tokens at a time; the backward pass recomputes each chunk's logits."""
  b, t, d = hidden.shape
  n = b * t
  pad = -n % chunk
  xs = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0))).reshape(-1, chunk, d)
  ys = jnp.pad(targets.reshape(n), (0, pad)).reshape(-1, chunk)

  @jax.checkpoint
  def one(head, x, y):
    return _scores(decoder_lib.head_logits(x, head), y, temperature)

  picked, entropy = jax.lax.map(lambda xy: one(head, *xy), (xs, ys))
  unpad = lambda a: a.reshape(-1)[:n].reshape(b, t)
  return unpad(picked), unpad(entropy)
