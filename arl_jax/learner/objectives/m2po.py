"""M2PO (second-moment masking, no ratio clipping): its loss, the mask (the
update computes it over a whole minibatch first when it accumulates
microbatches), its knob and its registry entry."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from arl_jax.core import settings
from arl_jax.learner import loss_entry
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import mismatch as mismatch_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class M2po:
  """M2PO's knob (`m2po`).

  Attributes:
    tau: the bound of the second moment of the log-ratio over kept tokens.
  """

  tau: float = 0.04

  def __post_init__(self):
    settings.check(self.tau > 0, "tau", f"must be > 0, got {self.tau}")


def m2po_keep_mask(log_ratio, loss_mask, tau: float):
  """Second-moment masking (M2PO, Zheng et al., 2025): drop the tokens with the
  largest `log_ratio^2` until the mean of the rest is `<= tau`.

  Sorting ascending, the prefix means of the squares never decrease, so the
  kept set is the longest prefix whose mean is `<= tau`. Returns `[B, L]`
  float32, 1 on kept tokens.
  """
  chex.assert_equal_shape([log_ratio, loss_mask])
  sq = jnp.where(loss_mask > 0, jnp.square(log_ratio), jnp.inf).reshape(-1)
  order = jnp.argsort(sq)
  sorted_sq = sq[order]
  valid = jnp.isfinite(sorted_sq)
  count = jnp.arange(1, sq.shape[0] + 1, dtype=jnp.float32)
  prefix_mean = jnp.cumsum(jnp.where(valid, sorted_sq, 0.0)) / count
  num_kept = jnp.sum(valid & (prefix_mean <= tau))
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(sq.shape[0]))
  return (rank < num_kept).reshape(log_ratio.shape).astype(jnp.float32) * loss_mask


def m2po(logprobs, behaviour_logprobs, advantages, loss_mask, *, proximal_logprobs=None,
         token_lag=None, segment_ids=None, tau: float = 0.04,
         correction: mismatch_lib.Correction | None = None, keep=None):
  """M2PO (Zheng et al., 2025): second-moment masking, then an importance-weighted
  policy gradient on the kept tokens, without ratio clipping:

    loss_t = -keep_t * w_t * r_t * A_t

  The mask is computed on `log(pi_theta / mu)` (stop-gradient) over the tokens
  of this call, or given as `keep` (`[B, L]`, 1 on kept tokens): the update
  computes it over a whole minibatch first when it accumulates microbatches,
  so that each microbatch is masked as the one pass would mask it.
  """
  logprobs, behaviour_logprobs, advantages, log_r, w, metrics = losses_lib.prepare(
      logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag,
      correction, segment_ids)
  r = jnp.exp(log_r)
  log_ratio = jax.lax.stop_gradient(logprobs - behaviour_logprobs)
  if keep is None:
    keep = m2po_keep_mask(log_ratio, loss_mask, tau)
  else:
    chex.assert_equal_shape([keep, loss_mask])
    keep = keep * loss_mask
  metrics["masked_fraction"] = losses_lib.masked_mean(1.0 - keep, loss_mask)
  metrics["m2_kept"] = losses_lib.masked_mean(jnp.square(log_ratio), keep)
  return jnp.where(keep > 0, -w * r * advantages, 0.0), metrics


ENTRIES = {"m2po": loss_entry.LossEntry(
    fn=m2po, knobs=M2po,
    kwargs=lambda k, c: dict(tau=k.tau, correction=c.correction, keep=c.minibatch_keep),
    age_decay=False, minibatch_mask=lambda log_ratio, mask, k: m2po_keep_mask(log_ratio, mask,
                                                                            k.tau))}
