"""Corrections of the gap between the policy the learner trains from and the
one that sampled: truncated importance weights and masks, whatever the loss.

In the decoupled objective (`losses`) each trained token carries a constant
off-policy weight `w_t = pi_prox(a_t) / mu(a_t)`: the learner's probability at
the start of the batch over the one recorded when the token was sampled. It
holds both the policy lag (versions since sampling) and the trainer/sampler
mismatch (two implementations of the same weights disagreeing: kernels,
dtypes, batch shapes; the whole ratio at lag 0). Left alone, a few tokens the
sampler drew with a much lower probability than the learner gives them carry
huge weights. The corrections, in the order applied:

- a mask (rejection): `token` drops the tokens whose `w_t` lies outside
  `[mismatch_low, mismatch_high]` (IcePop, the Ling team, 2025, as slime and
  OpenRLHF run it); `sequence` drops whole sequences whose geometric-mean
  weight `exp(mean_t log w_t)` lies outside the band (verl's `rollout_rs`
  "geometric"). A dropped token keeps its place in the aggregation's
  denominator: it trains nothing, it is not averaged away.
- a truncation of the weight that is left: `tis_cap` per token,
  `min(w_t, C)` (truncated importance sampling, Yao et al., 2025); or
  `seq_tis_cap` per sequence, every token of sequence i weighted by
  `min(prod_t w_t, C)` (verl's sequence-level `rollout_is`): unbiased for
  sequence-level objectives, high variance for long ones.

The weights are constants (stop-gradient), computed once per token from
log-probs already at hand, so a correction costs no forward pass. The
fractions they drop and truncate are metrics: `mismatch_masked_fraction` of
the loss mask's tokens, `*_truncated_fraction` of the tokens that train (the
ones the mask kept: a masked token's weight is not truncated, it is 0). A
sequence is a segment of the rows (`segments.py`), so padded and packed rows
are corrected alike.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from arl_jax.core import settings
from arl_jax.learner import segments as segments_lib

MASKS = ("none", "token", "sequence")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Correction:
  """The behaviour-weight corrections (keys of the config's `learner` section).

  Any of them on makes the objective decoupled (`losses`): with one optimizer
  step per batch the proximal policy is the trained one's own log-probs,
  stop-gradient, so that costs no extra forward pass.

  Attributes:
    tis_cap: token-level truncated importance sampling, `min(w_t, tis_cap)`
      (0: off).
    seq_tis_cap: sequence-level truncated importance sampling, each token of
      a sequence weighted by `min(prod_t w_t, seq_tis_cap)` (0: off; not
      with `tis_cap`).
    mismatch_mask: none | token (IcePop) | sequence (geometric mean).
    mismatch_low: the band's lower end (a weight below it is masked).
    mismatch_high: the band's upper end (a weight above it is masked).
  """

  tis_cap: float = 0.0
  seq_tis_cap: float = 0.0
  mismatch_mask: str = "none"
  mismatch_low: float = 0.5
  mismatch_high: float = 2.0

  def __post_init__(self):
    for key in ("tis_cap", "seq_tis_cap"):
      value = getattr(self, key)
      settings.check(isinstance(value, (int, float)) and (value == 0 or value >= 1), key,
                     f"must be 0 (off) or >= 1, got {value!r}")
    settings.check(not (self.tis_cap and self.seq_tis_cap), "seq_tis_cap",
                   f"is a second truncation of the same weights; set it or tis_cap "
                   f"(= {self.tis_cap}), not both")
    settings.check(self.mismatch_mask in MASKS, "mismatch_mask",
                   f"must be one of {MASKS}, got {self.mismatch_mask!r}")
    settings.check(0 <= self.mismatch_low < 1 < self.mismatch_high, "mismatch_low",
                   f"the band must hold 1: 0 <= mismatch_low < 1 < mismatch_high, got "
                   f"[{self.mismatch_low}, {self.mismatch_high}]")

  @property
  def is_on(self) -> bool:
    return bool(self.tis_cap or self.seq_tis_cap or self.mismatch_mask != "none")


def _fraction(flag, tokens):
  """The share of `tokens` (a 0/1 or bool mask) where `flag` holds."""
  return segments_lib.masked_mean(flag.astype(jnp.float32), tokens.astype(jnp.float32))


def behaviour_weights(log_w, loss_mask, correction: Correction | None, segment_ids=None):
  """The corrected off-policy weight of every token and the correction's metrics.

  Args:
    log_w: `[B, L]` `log pi_prox - log mu`, already 0 off the mask (a masked
      column may hold anything before that).
    loss_mask: `[B, L]` float32, 1 on trained tokens.
    correction: the corrections to apply (None: the weight as it is).
    segment_ids: `[B, L]` the rows' sequences (None: one a row).

  Returns:
    `(w [B, L] stop-gradient float32, metrics)`: 0 on masked tokens and off
    the loss mask.
  """
  log_w = jax.lax.stop_gradient(jnp.where(loss_mask > 0, log_w, 0.0))
  c = correction or Correction()
  metrics = {"behaviour_weight_mean": segments_lib.masked_mean(jnp.exp(log_w), loss_mask)}
  keep = loss_mask > 0
  if c.mismatch_mask != "none":
    if c.mismatch_mask == "token":
      band_value = log_w
    else:  # the log of each sequence's geometric-mean weight
      band_value = segments_lib.sequence_means(log_w, loss_mask, segment_ids)
    low = math.log(c.mismatch_low) if c.mismatch_low > 0 else -math.inf
    outside = (band_value < low) | (band_value > math.log(c.mismatch_high))
    metrics["mismatch_masked_fraction"] = _fraction(outside, loss_mask)
    keep = keep & ~outside
  if c.seq_tis_cap:
    log_seq = segments_lib.sequence_sums(log_w, loss_mask, segment_ids)
    cap = math.log(c.seq_tis_cap)
    metrics["seq_tis_truncated_fraction"] = _fraction(log_seq > cap, keep)
    w = jnp.exp(jnp.minimum(log_seq, cap))  # (the product in log space: it may overflow)
  else:
    w = jnp.exp(log_w)
    if c.tis_cap:
      metrics["tis_truncated_fraction"] = _fraction(w > c.tis_cap, keep)
      w = jnp.minimum(w, c.tis_cap)
  return jnp.where(keep, w, 0.0), metrics

