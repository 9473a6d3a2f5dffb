"""CISPO (MiniMax-M1): the clipped importance weight on a REINFORCE term, its
knobs and its registry entry."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from arl_jax.core import settings
from arl_jax.learner import loss_entry
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import mismatch as mismatch_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cispo:
  """CISPO's knobs (`cispo`): the bounds of its stop-gradient weight.

  Attributes:
    cispo_eps_low: the weight's floor is 1 - cispo_eps_low (1: no floor, as
      MiniMax-M1 ran it).
    cispo_eps_high: the weight's cap is 1 + cispo_eps_high (MiniMax-M1 tuned
      only this one).
  """

  cispo_eps_low: float = 1.0
  cispo_eps_high: float = 2.0

  def __post_init__(self):
    settings.check(0 <= self.cispo_eps_low <= 1 and self.cispo_eps_high > 0, "cispo_eps_low",
           f"the weight's bounds must satisfy 0 <= cispo_eps_low <= 1 and cispo_eps_high > 0, "
           f"got {self.cispo_eps_low}, {self.cispo_eps_high}")


def cispo(logprobs, behaviour_logprobs, advantages, loss_mask, *, proximal_logprobs=None,
          token_lag=None, segment_ids=None, eps_low: float = 1.0, eps_high: float = 2.0,
          correction: mismatch_lib.Correction | None = None, age_decay: float = 0.0):
  """CISPO (MiniMax-M1, arXiv:2506.13585): a REINFORCE term weighted by the
  clipped importance ratio, the weight stop-gradient:

    loss_t = -w_t * sg(clip(r_t, 1 - eps_low_t, 1 + eps_high_t)) * A_t * logp_theta_t

  Unlike the clipped ratio, no token's gradient is ever zeroed: a clipped
  token still moves the policy, with a bounded weight (the low-probability
  "fork" tokens PPO's clip drops after its first update keep training).
  MiniMax-M1 set no lower bound (`eps_low` = 1: the weight's floor is 0) and
  tuned only the upper one. The loss value is not a ratio: compare gradients,
  not losses, with `clipped_ratio`. With `age_decay`, both bounds shrink with
  a token's lag as the clipped ratio's do.
  """
  logprobs, behaviour_logprobs, advantages, log_r, w, metrics = losses_lib.prepare(
      logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag,
      correction, segment_ids)
  r = jnp.exp(jax.lax.stop_gradient(log_r))
  scale = losses_lib.age_scale(token_lag, age_decay)
  low, high = 1.0 - eps_low * scale, 1.0 + eps_high * scale
  metrics["clip_fraction"] = losses_lib.masked_mean(((r < low) | (r > high)).astype(jnp.float32),
                                         loss_mask)
  weight = jnp.clip(r, low, high)
  return jnp.where(loss_mask > 0, -w * weight * advantages * logprobs, 0.0), metrics


ENTRIES = {"cispo": loss_entry.LossEntry(
    fn=cispo, knobs=Cispo,
    kwargs=lambda k, c: dict(eps_low=k.cispo_eps_low, eps_high=k.cispo_eps_high,
                             correction=c.correction, age_decay=c.age_decay))}
