"""V-trace's policy loss (IMPALA's truncated importance-sampled policy
gradient), its knobs (the critic's too: `update.py` reads them for the
targets) and its registry entry."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from arl_jax.core import settings
from arl_jax.learner import loss_entry
from arl_jax.learner import losses as losses_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Vtrace:
  """V-trace's knobs (`vtrace` below; its critic's targets: `learner/vtrace.py`).

  Attributes:
    rho_bar: truncation of the importance weights.
    c_bar: with a critic: truncation of the trace coefficients.
    lam: with a critic: the traces' lambda.
    vf_coef: with a critic: weight of the critic's loss.
  """

  rho_bar: float = 1.0
  c_bar: float = 1.0
  lam: float = 1.0
  vf_coef: float = 0.5

  def __post_init__(self):
    settings.check(self.rho_bar >= 1, "rho_bar", f"must be >= 1, got {self.rho_bar}")
    settings.check(0 < self.c_bar <= self.rho_bar, "c_bar",
           f"must be in (0, rho_bar={self.rho_bar}], got {self.c_bar}")
    settings.check(0 <= self.lam <= 1, "lam", f"must be in [0, 1], got {self.lam}")
    loss_entry.non_negative(self, "vf_coef")


def vtrace(logprobs, behaviour_logprobs, advantages, loss_mask, *, proximal_logprobs=None,
           token_lag=None, segment_ids=None, rho_bar: float = 1.0, age_decay: float = 0.0):
  """Truncated importance-sampled policy gradient (IMPALA's V-trace actor loss,
  Espeholt et al., 2018):

    loss_t = -sg(min(rho_t, rho_bar_t)) * A_t * logp_theta_t

  Its gradient is `-min(rho_t, rho_bar) A_t grad log pi_theta`. With a critic,
  `A_t` are the V-trace policy-gradient advantages
  `min(rho_t, rho_bar) (r_t + v_{t+1} - V(s_t))` without the leading weight
  (`vtrace_lib.vtrace_targets`); without one, the group-relative advantage
  of the rollout. V-trace corrects against mu directly, so it takes no
  proximal policy. With `age_decay`, `rho_bar_t = losses_lib.truncation_level(rho_bar,
  lag_t, age_decay)`.
  """
  del segment_ids  # (token-level)
  losses_lib.check_inputs(logprobs, behaviour_logprobs, advantages, loss_mask, token_lag)
  if proximal_logprobs is not None:
    raise ValueError("vtrace corrects against the behaviour policy; it takes no proximal policy")
  logprobs, behaviour_logprobs, advantages = losses_lib.zero_masked(loss_mask, logprobs,
                                                          behaviour_logprobs, advantages)
  rho = jnp.exp(jax.lax.stop_gradient(logprobs - behaviour_logprobs))
  level = losses_lib.truncation_level(rho_bar, token_lag, age_decay)
  truncated = jnp.minimum(rho, level)
  metrics = {"clip_fraction": losses_lib.masked_mean((rho > level).astype(jnp.float32), loss_mask)}
  return jnp.where(loss_mask > 0, -truncated * advantages * logprobs, 0.0), metrics


ENTRIES = {"vtrace": loss_entry.LossEntry(
    fn=vtrace, knobs=Vtrace, kwargs=lambda k, c: dict(rho_bar=k.rho_bar, age_decay=c.age_decay),
    corrections=False, trains_critic=True)}
