"""Drawing one token per row from float32 logits, and its behaviour log-prob.

The recorded log-prob is that of the distribution actually sampled from:
tempered, and truncated by top-k / top-p (excluded tokens get -inf), so the
importance ratio the learner computes stays honest. Settings are a
`sampling.SamplingSettings`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _truncate(logits, settings):
  """Applies top-k / top-p by setting excluded logits to -inf."""
  if settings.top_k:
    kth = jax.lax.top_k(logits, settings.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if settings.top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_probs = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), order, axis=-1)
    # Keep a token if the mass strictly before it is < p (the top token always).
    keep_sorted = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < settings.top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
        keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return logits


def sample_from_logits(logits, keys, columns, settings):
  """Draws one token per row and returns it with its log-probability.

  Inverse-CDF sampling: one uniform per row against the cumulative softmax.
  `jax.random.categorical` draws B x V Gumbel noises, which cost half a model
  forward at a 32k vocabulary on CPU (docs/jax_notes.md); the distribution and the
  recorded log-prob are the same.

  Args:
    logits: `[B, V]` float32.
    keys: `[B, 2]` uint32 per-row keys.
    columns: `[B]` (or `[]`) int32 offset of the token within its completion
      (0 for the first), folded into the keys so that a draw depends only on
      (row key, offset): not on slot, prompt bucket, batching or timing.
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
    logp = jax.nn.log_softmax(_truncate(logits / settings.temperature, settings), axis=-1)
    columns = jnp.broadcast_to(columns, keys.shape[:1])
    draw = lambda k, c: jax.random.uniform(jax.random.fold_in(k, c))
    # 1 - U lies in (0, 1]: a draw of exactly 0 would pick token 0 even when
    # its probability is 0, and record a log-prob of -inf.
    uniforms = 1.0 - jax.vmap(draw)(keys, columns)
    probs = jnp.exp(logp)
    cdf = jnp.cumsum(probs, axis=-1)
    # The first token whose cumulative mass reaches the draw, among tokens of
    # non-zero probability: a parallel cumsum may dip by one rounding unit, and
    # a token outside top-k/top-p must never be picked (its log-prob is -inf).
    hit = (cdf >= uniforms[:, None] * cdf[:, -1:]) & (probs > 0)
    tokens = jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1),
                       jnp.argmax(probs, axis=-1)).astype(jnp.int32)
  token_logp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  return tokens, token_logp
