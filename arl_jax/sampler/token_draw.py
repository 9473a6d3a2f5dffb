"""Drawing one token per row from float32 logits, and its behaviour log-prob;
the PRNG keys the draws come from.

The recorded log-prob is that of the distribution actually sampled from:
tempered, and truncated by top-k / top-p / min-p (excluded tokens get -inf), so the
importance ratio the learner computes stays honest. Settings are a
`sampling.SamplingSettings`.

A draw's key is a function of (seed, group id, sample index, turn) and the
token's offset in its segment only (`segment_keys`, `row_keys`): never of
the slot, the batch or the moment, so that a segment samples the same tokens
however it is scheduled, preempted, shared or resumed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Draw(NamedTuple):
  """One token per row and what is recorded with it.

  Attributes:
    tokens: `[B]` int32 the drawn tokens.
    logprobs: `[B]` float32 their log-probs under the distribution drawn from.
    top_ids: `[B, K]` int32 the K most likely tokens of that distribution
      (K = `settings.top_logprobs`, 0 for none), most likely first.
    top_logprobs: `[B, K]` float32 their log-probs (-inf for a token the
      truncation excluded).
  """

  tokens: jax.Array
  logprobs: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array


def _truncate(logits, settings):
  """Applies top-k / top-p / min-p by setting excluded logits to -inf."""
  if settings.min_p:
    # p >= min_p * p_max  <=>  logit >= max logit + log(min_p) (the top token always).
    floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(settings.min_p)
    logits = jnp.where(logits < floor, -jnp.inf, logits)
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
    A `Draw`: the tokens, their log-probs, and the `settings.top_logprobs`
    most likely alternatives of the same distribution (what the gateway
    answers `top_logprobs` with: the chosen token's log-prob and its
    alternatives' are comparable).
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
  k = settings.top_logprobs
  if k:
    top_logp, top_ids = jax.lax.top_k(logp, k)
  else:  # (zero-width: the slot state's alternatives have no columns)
    top_logp, top_ids = jnp.zeros((logp.shape[0], 0), jnp.float32), jnp.zeros(
        (logp.shape[0], 0), jnp.int32)
  return Draw(tokens, token_logp, top_ids.astype(jnp.int32), top_logp)


def segment_keys(base_key, key_ids):
  """Per-segment PRNG keys `[R, 2]` from a base key and each segment's ids.

  Traceable, so that the engine derives its keys inside the jitted insert
  (one program per insert shape, and no eager key math per admission).

  Args:
    base_key: `[2]` uint32, `jax.random.PRNGKey(seed)`.
    key_ids: `[R, 3]` uint32 (group id, sample index, turn) of each row
      (`key_ids`).

  Returns:
    `[R, 2]` uint32: fold_in(fold_in(base, group), sample), folded once more
    with the turn unless it is 0.
  """

  def fold(ids):
    key = jax.random.fold_in(jax.random.fold_in(base_key, ids[0]), ids[1])
    # Turn 0 keeps the single-turn key, so adding turns changes no earlier draw.
    return jnp.where(ids[2] == 0, key, jax.random.fold_in(key, ids[2]))

  return jax.vmap(fold)(key_ids)


def key_ids(group_ids, sample_indices, turns=None) -> np.ndarray:
  """`[R, 3]` uint32 (group id, sample index, turn) rows for `segment_keys`;
  `turns` None: every row's turn is 0."""
  turns = np.zeros(len(group_ids)) if turns is None else turns
  return np.stack([np.asarray(group_ids, np.uint32), np.asarray(sample_indices, np.uint32),
                   np.asarray(turns, np.uint32)], axis=1).reshape(-1, 3)


# One program per row count, where the unjitted vmap would dispatch (and
# compile) each of its primitives on its own.
_segment_keys = jax.jit(segment_keys)


def row_keys(seed: int, group_ids, sample_indices, turns=None):
  """Per-segment PRNG keys `[B, 2]`: a function of (seed, group id, sample index, turn) only.

  Keeping draws independent of slot assignment and batching lets the
  asynchronous pipeline and the synchronous reference sample identical tokens.
  A multi-turn episode samples each segment (turn) with its own key, since
  draws are keyed by the offset inside the segment. (`segment_keys` computes
  the same keys inside a jitted program.)
  """
  return _segment_keys(jax.random.PRNGKey(seed), key_ids(group_ids, sample_indices, turns))
