"""GSPO and its token variant (Qwen): one clipped length-normalised ratio a
sequence, their knobs and their registry entries."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from arl_jax.core import settings
from arl_jax.learner import loss_entry
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import mismatch as mismatch_lib
from arl_jax.learner import segments as segments_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gspo:
  """GSPO's knobs (`gspo`, `gspo_token`): the clip range of a
  sequence's length-normalised ratio (the paper's 3e-4 and 4e-4: a sequence
  ratio is a geometric mean, far closer to 1 than a token's).

  Attributes:
    gspo_eps_low: the ratio's lower clip, 1 - gspo_eps_low.
    gspo_eps_high: the ratio's upper clip, 1 + gspo_eps_high.
  """

  gspo_eps_low: float = 3e-4
  gspo_eps_high: float = 4e-4

  def __post_init__(self):
    settings.check(0 <= self.gspo_eps_low < 1 and self.gspo_eps_high >= 0, "gspo_eps_low",
           "clip ranges must satisfy 0 <= gspo_eps_low < 1 and gspo_eps_high >= 0")


def gspo(logprobs, behaviour_logprobs, advantages, loss_mask, *, proximal_logprobs=None,
         token_lag=None, segment_ids=None, eps_low: float = 3e-4, eps_high: float = 4e-4,
         correction: mismatch_lib.Correction | None = None, age_decay: float = 0.0):
  """GSPO (Zheng et al., 2025, arXiv:2507.18071): the clipped surrogate on the
  sequence's length-normalised likelihood ratio,

    s_i = exp(mean_{t in i} log r_t),
    loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

  placed on each of sequence i's tokens (times its off-policy weight `w_t`),
  so `seq_mean_token_mean` aggregation gives the paper's objective
  `1/G sum_i loss_i` (`token_mean` weighs long sequences more). A sequence
  is clipped whole, not token by token, hence the paper's small ranges
  (3e-4, 4e-4: the defaults). `advantages` are read per token; a rollout's
  are constant over its tokens. With `age_decay` a token's bound shrinks with
  its own lag.
  """
  logprobs, behaviour_logprobs, advantages, log_r, w, metrics = losses_lib.prepare(
      logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag,
      correction, segment_ids)
  s = jnp.exp(segments_lib.sequence_means(log_r, loss_mask, segment_ids))
  return losses_lib.clipped_surrogate(s, advantages, loss_mask, token_lag, eps_low, eps_high,
                                      age_decay, w, metrics)


def gspo_token(logprobs, behaviour_logprobs, advantages, loss_mask, *, proximal_logprobs=None,
               token_lag=None, segment_ids=None, eps_low: float = 3e-4, eps_high: float = 4e-4,
               correction: mismatch_lib.Correction | None = None, age_decay: float = 0.0):
  """GSPO-token (Zheng et al., 2025, section 4.3): per-token ratios whose value
  is the sequence's and whose gradient is each token's own,

    s_{i,t} = sg(s_i) * pi_theta(a_t) / sg(pi_theta(a_t)),
    loss_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_{i,t})

  so advantages may differ token by token. With a rollout's advantage on all
  its tokens the loss equals `gspo`'s, and so does the gradient when the
  off-policy weight `w_t` is constant within each sequence (the coupled
  objective, `w = 1`; or `seq_tis_cap`). A decoupled run's per-token weights
  make them differ: GSPO spreads a sequence's summed weight evenly over its
  tokens' gradients, GSPO-token weighs each token's gradient by its own."""
  logprobs, behaviour_logprobs, advantages, log_r, w, metrics = losses_lib.prepare(
      logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag,
      correction, segment_ids)
  log_s = jax.lax.stop_gradient(segments_lib.sequence_means(log_r, loss_mask, segment_ids))
  s = jnp.exp(log_s + logprobs - jax.lax.stop_gradient(logprobs))
  return losses_lib.clipped_surrogate(s, advantages, loss_mask, token_lag, eps_low, eps_high,
                                      age_decay, w, metrics)


def _gspo_kwargs(k: Gspo, c: loss_entry.LossContext) -> dict:
  return dict(eps_low=k.gspo_eps_low, eps_high=k.gspo_eps_high, correction=c.correction,
              age_decay=c.age_decay)


ENTRIES = {"gspo": loss_entry.LossEntry(fn=gspo, knobs=Gspo, kwargs=_gspo_kwargs),
           "gspo_token": loss_entry.LossEntry(fn=gspo_token, knobs=Gspo, kwargs=_gspo_kwargs)}
