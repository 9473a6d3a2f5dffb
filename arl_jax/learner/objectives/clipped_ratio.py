"""The clipped ratio loss (PPO / GRPO; DAPO's clip-higher, the dual clip):
the default policy loss, its knobs and its registry entry."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from arl_jax.core import settings
from arl_jax.learner import loss_entry
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import mismatch as mismatch_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClippedRatio:
  """The clipped ratio loss's knobs (`clipped_ratio`).

  Attributes:
    eps_low: the ratio's lower clip, 1 - eps_low.
    eps_high: the ratio's upper clip, 1 + eps_high (> eps_low: clip-higher, DAPO).
    dual_clip: bound of negative-advantage terms, c > 1 (0: off).
  """

  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float = 0.0

  def __post_init__(self):
    settings.check(0 <= self.eps_low < 1 and self.eps_high >= 0, "eps_low",
           "clip ranges must satisfy 0 <= eps_low < 1 and eps_high >= 0")
    settings.check(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip",
           f"must be 0 (off) or > 1, got {self.dual_clip}")


def clipped_ratio(logprobs, behaviour_logprobs, advantages, loss_mask, *,
                  proximal_logprobs=None, token_lag=None, segment_ids=None,
                  eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None,
                  correction: mismatch_lib.Correction | None = None, age_decay: float = 0.0):
  """PPO/GRPO clipped surrogate per token.

    loss_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low_t, 1 + eps_high_t) A_t)

  (Schulman et al., 2017; asymmetric clip as DAPO, Yu et al., 2025). With
  `dual_clip = c > 1`, tokens with A < 0 have their loss capped at `-c A`
  (Ye et al., 2020), so one huge ratio cannot dominate the batch.

  Args:
    logprobs: `[B, L]` float32 log-probs under the params being trained.
    behaviour_logprobs: `[B, L]` recorded at sampling time.
    advantages: `[B, L]`.
    loss_mask: `[B, L]` float32, 1 on trained tokens.
    proximal_logprobs: optional `[B, L]`, the decoupled objective's pi_prox.
    token_lag: optional `[B, L]` int, versions since each token was sampled.
    segment_ids: optional `[B, L]`, the rows' sequences (for sequence-level
      corrections).
    eps_low, eps_high: clip ranges.
    dual_clip: optional c > 1.
    correction: optional corrections of the decoupled weight `pi_prox / mu`.
    age_decay: age-aware trust region (0: off).

  Returns:
    `(per_token_loss [B, L], metrics)`.
  """
  logprobs, behaviour_logprobs, advantages, log_r, w, metrics = losses_lib.prepare(
      logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag,
      correction, segment_ids)
  return losses_lib.clipped_surrogate(jnp.exp(log_r), advantages, loss_mask, token_lag, eps_low,
                            eps_high, age_decay, w, metrics, dual_clip=dual_clip)


ENTRIES = {"clipped_ratio": loss_entry.LossEntry(
    fn=clipped_ratio, knobs=ClippedRatio,
    kwargs=lambda k, c: dict(eps_low=k.eps_low, eps_high=k.eps_high,
                             dual_clip=k.dual_clip or None, correction=c.correction,
                             age_decay=c.age_decay))}
