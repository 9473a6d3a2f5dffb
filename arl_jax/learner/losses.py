"""Token-level policy losses against recorded behaviour log-probabilities.

Pure functions of arrays (rlax style): shapes checked on entry, no model call,
no config object. Each returns `(loss, metrics)` where metrics are scalars.
Shapes: B rows, L columns; masks select the tokens the policy sampled.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp


def masked_mean(x, mask):
  """Mean of `x` over `mask` (0 when the mask is empty)."""
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def clipped_ratio(logprobs, behaviour_logprobs, advantages, loss_mask, *, eps_low: float = 0.2,
                  eps_high: float = 0.2, dual_clip: float | None = None):
  """PPO/GRPO clipped surrogate per token, aggregated as a token mean.

  With `rho_t = exp(log pi_theta(a_t|s_t) - log mu(a_t|s_t))`, where mu is the
  behaviour log-prob recorded when the token was sampled (so a rollout that
  spans several versions is corrected token by token):

    loss_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)

  (Schulman et al., 2017; asymmetric clip as DAPO, Yu et al., 2025). With
  `dual_clip = c > 1`, tokens with A < 0 have their loss capped at `-c A`
  (Ye et al., 2020), so one huge ratio cannot dominate the batch.

  Args:
    logprobs: `[B, L]` float32 log-probs under the params being trained.
    behaviour_logprobs: `[B, L]` float32 recorded at sampling time.
    advantages: `[B, L]` float32 (per-rollout advantages broadcast over L).
    loss_mask: `[B, L]` float32, 1 on trained tokens.
    eps_low: lower clip range.
    eps_high: upper clip range.
    dual_clip: optional c > 1.

  Returns:
    `(loss, metrics)`.
  """
  chex.assert_rank([logprobs, behaviour_logprobs, advantages, loss_mask], 2)
  chex.assert_equal_shape([logprobs, behaviour_logprobs, advantages, loss_mask])
  chex.assert_type([logprobs, behaviour_logprobs, advantages, loss_mask], float)
  log_ratio = (logprobs - behaviour_logprobs) * loss_mask
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
  if dual_clip is not None:
    per_token = jnp.where(advantages < 0, jnp.minimum(per_token, -dual_clip * advantages),
                          per_token)
  loss = masked_mean(per_token, loss_mask)
  # A token is "clipped" when the clipped branch is the active one.
  is_clipped = (ratio * advantages > clipped * advantages).astype(jnp.float32)
  metrics = {"clip_fraction": masked_mean(is_clipped, loss_mask)}
  metrics.update(ratio_statistics(log_ratio, loss_mask))
  return loss, metrics


def ratio_statistics(log_ratio, mask):
  """Importance-ratio statistics over masked tokens: the signal to watch as lag grows."""
  ratio = jnp.exp(log_ratio)
  big = jnp.finfo(jnp.float32).max
  mean = masked_mean(ratio, mask)
  m2 = masked_mean(ratio * ratio, mask)
  return {
      "ratio_mean": mean,
      "ratio_std": jnp.sqrt(jnp.maximum(m2 - mean * mean, 0.0)),
      "ratio_max": jnp.max(jnp.where(mask > 0, ratio, -big)),
      "ratio_min": jnp.min(jnp.where(mask > 0, ratio, big)),
      "ratio_m2": m2,
      "abs_log_ratio": masked_mean(jnp.abs(log_ratio), mask),
  }


LOSSES = {"clipped_ratio": clipped_ratio}
