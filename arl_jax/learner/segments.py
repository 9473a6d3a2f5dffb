"""Per-sequence reductions over rows that hold several sequences (segments).

A TrainBatch row holds one rollout (padded rows) or several (packed rows):
`segment_ids` `[B, L]` is 0 on padding and k on the row's k-th sequence, each
sequence one run of columns. The losses' per-sequence quantities (a
sequence's trained-token count, its last sampled token, where its V-trace
recursion restarts) are computed per segment, so they are the same whether a
rollout has a row of its own or shares one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_mean(x, mask):
  """Mean of `x` over `mask` (0 when the mask is empty); entries of `x` where
  the mask is 0 never count, even NaN or inf."""
  return jnp.sum(jnp.where(mask > 0, x, 0.0) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def masked_variance(x, mask, mean=None):
  """Variance of `x` over `mask` (0 when the mask is empty), as the mean
  squared deviation from the mean (`mean`, if already at hand). Two passes on
  purpose: `E[x^2] - E[x]^2` in float32 cancels to noise when the spread is
  small next to the mean (importance ratios near 1 read a std of ~3e-4 when
  they are all equal), and can come out negative."""
  mean = masked_mean(x, mask) if mean is None else mean
  return masked_mean(jnp.square(jnp.where(mask > 0, x, 0.0) - mean), mask)


def sequence_sums(x, mask, segment_ids=None):
  """`[B, L]`: at each column, the sum of `x` over the columns of its sequence
  where `mask > 0` (each row one sequence when `segment_ids` is None); NaN or
  inf off the mask never count."""
  x = jnp.where(mask > 0, x, 0.0)
  if segment_ids is None:
    return jnp.broadcast_to(jnp.sum(x, axis=1, keepdims=True), x.shape)
  return totals(x, segment_ids)


def sequence_means(x, mask, segment_ids=None):
  """`[B, L]`: at each column, the mean of `x` over its sequence's masked
  columns (0 for a sequence with none)."""
  return sequence_sums(x, mask, segment_ids) / jnp.maximum(
      sequence_sums(jnp.ones_like(x), mask, segment_ids), 1.0)


def _global_ids(segment_ids):
  """`[B * L]` ids unique over the batch: a row's ids are at most L."""
  rows, length = segment_ids.shape
  return ((jnp.arange(rows)[:, None] * (length + 1) + segment_ids).reshape(-1),
          rows * (length + 1))


def totals(x, segment_ids):
  """`[B, L]`: at each column, the sum of `x` over its segment's columns."""
  ids, n = _global_ids(segment_ids)
  sums = jax.ops.segment_sum(x.reshape(-1), ids, num_segments=n)
  return sums[ids].reshape(x.shape)


def last_marked(mask, segment_ids):
  """`[B, L]` bool: True at the last column of each segment where `mask > 0`."""
  ids, n = _global_ids(segment_ids)
  cols = jnp.broadcast_to(jnp.arange(mask.shape[1]), mask.shape)
  last = jax.ops.segment_max(jnp.where(mask > 0, cols, -1).reshape(-1), ids, num_segments=n)
  return (mask > 0) & (cols == last[ids].reshape(mask.shape))


def ends(segment_ids):
  """`[B, L]` bool: True at each segment's last column (the next column
  belongs to another segment, or the row ends there)."""
  following = jnp.concatenate([segment_ids[:, 1:], jnp.full_like(segment_ids[:, :1], -1)],
                              axis=1)
  return following != segment_ids
