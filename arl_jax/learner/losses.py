"""What every token-level policy loss shares: the conventions below, the
aggregation (`token_weights`), input checks and masking, the decoupled
objective's ratio and weight, the clipped surrogate, the age-aware trust
region, and the KL and ratio statistics. The losses themselves are one module
each in `learner/objectives/` (`loss_registry.py` collects them).

Pure functions of arrays (rlax style): shapes checked on entry, no model call,
no config object. Every token loss has the same leading arguments and returns
`(per_token_loss [B, L], metrics)`; the caller weighs tokens with
`token_weights` (the aggregation) and sums, so a batch split into microbatches
is aggregated exactly as the whole batch would be.

Shapes: B rows, L columns. `loss_mask` selects the tokens the policy sampled;
`advantages` are per token (a rollout's advantage broadcast over its tokens,
or per-token V-trace advantages). Notation: `log_ratio_t = logp_theta_t -
logp_mu_t`, `rho_t = exp(log_ratio_t)`, with mu the behaviour probability
recorded when the token was sampled, so a rollout that spans several policy
versions is corrected token by token.

The decoupled objective (AReaL; Fu et al., 2025; Hilton et al., 2021): when a
proximal policy `pi_prox` is given (recomputed at the start of a batch that
takes several optimizer steps), the trust region is taken around `pi_prox`,
`r_t = pi_theta / pi_prox`, and the off-policy correction is a separate
constant weight `w_t = pi_prox / mu`, which `mismatch.behaviour_weights`
truncates or masks as the run's `mismatch.Correction` says (truncated
importance sampling, IcePop, sequence masks). Without a proximal policy,
`r_t = rho_t` and `w_t = 1` (coupled).

Sequence-level losses (GSPO) reduce over each sequence's trained tokens: a
sequence is a segment of `segment_ids` (`segments.py`; None: one a row), so
a rollout is scored the same in a padded row of its own and in a packed row.

Age-aware trust region (`age_decay > 0`, off by default): a token sampled
`lag_t` versions ago gets the clip range `eps / (1 + age_decay * lag_t)` (and
V-trace truncation levels above 1 shrink the same way towards 1,
`truncation_level`, for the policy loss and the critic's targets alike), so
the oldest tokens may move the policy the least.

Masked columns (prompt, observation, padding, errored rollouts) may hold
anything, NaN and inf included (a behaviour log-prob the sampler never
recorded properly): every loss replaces them by 0 before its first nonlinear
op (`zero_masked`) and selects with `jnp.where`, so they reach neither the
loss nor its gradient nor the metrics. Multiplying by the mask would not do:
`NaN * 0` is NaN, and so is the cotangent `0 * exp(NaN)` of a `where` placed
only on the output.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from arl_jax.learner import mismatch as mismatch_lib
from arl_jax.learner import segments as segments_lib

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")


masked_mean = segments_lib.masked_mean


def zero_masked(loss_mask, *arrays):
  """Each array with 0 on the columns `loss_mask` leaves out (None stays None).

  Applied to a loss's inputs before any nonlinear op: the gradient of
  `where(on, x, 0)` is exactly 0 off the mask, whatever x held there."""
  on = loss_mask > 0
  return tuple(None if x is None else jnp.where(on, x, jnp.zeros_like(x)) for x in arrays)


def check_inputs(logprobs, behaviour_logprobs, advantages, loss_mask, *optional):
  arrays = [logprobs, behaviour_logprobs, advantages, loss_mask,
            *(x for x in optional if x is not None)]
  chex.assert_rank(arrays, 2)
  chex.assert_equal_shape(arrays)
  chex.assert_type([logprobs, behaviour_logprobs, advantages, loss_mask], float)


def token_weights(loss_mask, aggregation: str, norm_constant: float | None = None,
                  segment_ids=None):
  """`[B, L]` weights such that `sum(weights * per_token_loss)` is the loss.

  - `token_mean`: every trained token of the batch counts the same (DAPO).
  - `seq_mean_token_mean`: mean over each sequence's tokens, then over the
    sequences with at least one trained token (GRPO as published).
  - `seq_sum_norm`: each sequence's token sum divided by the constant
    `norm_constant` (e.g. the completion budget), then the mean over
    sequences (Dr. GRPO, Liu et al., 2025): no length bias.

  A sequence is a segment of `segment_ids` (`segments.py`; None: each row is
  one sequence), so packed rows weigh their rollouts as padded rows do.
  Computed once per minibatch (an optimizer step's rows) and sliced with it
  into microbatches, so accumulating the microbatches' gradients gives the
  minibatch's.
  """
  chex.assert_rank(loss_mask, 2)
  if segment_ids is None:
    per_sequence = jnp.broadcast_to(jnp.sum(loss_mask, axis=1, keepdims=True), loss_mask.shape)
  else:
    per_sequence = segments_lib.totals(loss_mask, segment_ids)
  # Each trained sequence's tokens add up to 1 here (rounded: it counts sequences).
  num_sequences = jnp.maximum(jnp.round(jnp.sum(
      jnp.where(loss_mask > 0, loss_mask / jnp.maximum(per_sequence, 1e-30), 0.0))), 1.0)
  if aggregation == "token_mean":
    return loss_mask / jnp.maximum(jnp.sum(loss_mask), 1.0)
  if aggregation == "seq_mean_token_mean":
    return loss_mask / (jnp.maximum(per_sequence, 1.0) * num_sequences)
  if aggregation == "seq_sum_norm":
    if norm_constant is None or norm_constant <= 0:
      raise ValueError(f"seq_sum_norm needs a positive norm_constant, got {norm_constant}")
    return loss_mask / (norm_constant * num_sequences)
  raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def age_scale(token_lag, age_decay: float):
  """`1 / (1 + age_decay * lag)` per token (1 everywhere when off)."""
  if not age_decay or token_lag is None:
    return 1.0
  return 1.0 / (1.0 + age_decay * jnp.maximum(token_lag, 0).astype(jnp.float32))


def truncation_level(bar: float, token_lag=None, age_decay: float = 0.0):
  """A V-trace truncation level (`rho_bar` or `c_bar`) under the age-aware
  trust region: `min(bar, 1 + (bar - 1) / (1 + age_decay * lag_t))` per token.

  A level above 1 shrinks towards 1 as the token ages; a level at or below 1
  is left as it is (moving it towards 1 would loosen it). Returns `bar`
  itself when `age_decay` is 0 or no lag is given, else `[B, L]` float32.
  """
  if not age_decay or token_lag is None:
    return bar
  return jnp.minimum(bar, 1.0 + (bar - 1.0) * age_scale(token_lag, age_decay))


def trust_region_log_ratio(logprobs, behaviour_logprobs, loss_mask, proximal_logprobs,
                            correction: mismatch_lib.Correction | None, segment_ids):
  """`(log r, w, metrics)`: the log of the ratio the trust region acts on, and
  the constant off-policy weight (see the module docstring). Inputs are
  already 0 off the mask (`zero_masked`), so `log r` is 0 there and `w` 0."""
  if proximal_logprobs is None:
    if correction is not None and correction.is_on:
      raise ValueError("a mismatch correction weighs pi_prox / mu: it needs proximal_logprobs "
                       "(the decoupled objective)")
    return logprobs - behaviour_logprobs, 1.0, {}
  w, metrics = mismatch_lib.behaviour_weights(proximal_logprobs - behaviour_logprobs, loss_mask,
                                              correction, segment_ids)
  return logprobs - proximal_logprobs, w, metrics


class Prepared(NamedTuple):
  """A loss's inputs after `prepare`: the arrays with 0 off the mask, and the
  decoupled objective's log-ratio and constant weight (`trust_region_log_ratio`)."""

  logprobs: jax.Array
  behaviour_logprobs: jax.Array
  advantages: jax.Array
  log_r: jax.Array
  w: object  # [B, L], or 1.0 (coupled)
  metrics: dict


def prepare(logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag,
            correction: mismatch_lib.Correction | None, segment_ids) -> Prepared:
  """What every loss with a trust region does first: check the shapes, zero
  the masked columns (before any nonlinear op), and take the ratio its trust
  region acts on with the off-policy weight."""
  check_inputs(logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag)
  logprobs, behaviour_logprobs, advantages, proximal_logprobs = zero_masked(
      loss_mask, logprobs, behaviour_logprobs, advantages, proximal_logprobs)
  log_r, w, metrics = trust_region_log_ratio(logprobs, behaviour_logprobs, loss_mask,
                                             proximal_logprobs, correction, segment_ids)
  return Prepared(logprobs, behaviour_logprobs, advantages, log_r, w, metrics)


def clipped_surrogate(r, advantages, loss_mask, token_lag, eps_low, eps_high, age_decay, w,
                       metrics, dual_clip=None):
  """The clipped surrogate's per-token loss `-w * min(r A, clip(r) A)` of
  ratios `r` `[B, L]` (each token's own: `clipped_ratio`; its sequence's:
  the GSPO losses), with the dual clip when `dual_clip` is set, and the
  fraction of tokens whose clipped branch is the active one."""
  scale = age_scale(token_lag, age_decay)
  clipped = jnp.clip(r, 1.0 - eps_low * scale, 1.0 + eps_high * scale)
  surrogate = jnp.minimum(r * advantages, clipped * advantages)
  if dual_clip is not None:
    surrogate = jnp.where(advantages < 0, jnp.maximum(surrogate, dual_clip * advantages),
                          surrogate)
  metrics["clip_fraction"] = masked_mean((r * advantages > clipped * advantages)
                                         .astype(jnp.float32), loss_mask)
  return jnp.where(loss_mask > 0, -w * surrogate, 0.0), metrics


def kl_to_reference(logprobs, reference_logprobs, loss_mask):
  """Per-token k3 estimate of KL(pi_theta || pi_ref) (Schulman, 2020), as GRPO:
  with `log q = logp_ref - logp_theta`, `exp(log q) - log q - 1 >= 0`."""
  chex.assert_equal_shape([logprobs, reference_logprobs, loss_mask])
  logprobs, reference_logprobs = zero_masked(loss_mask, logprobs, reference_logprobs)
  log_q = reference_logprobs - logprobs
  return jnp.where(loss_mask > 0, jnp.exp(log_q) - log_q - 1.0, 0.0)


def ratio_statistics(log_ratio, mask):
  """Importance-ratio statistics over masked tokens: the signal to watch as lag grows.

  `ratio_m2` is `E[rho^2]`; `ess` is the normalised effective sample size
  `E[rho]^2 / E[rho^2]` (1 on-policy, toward 0 as the weights degenerate),
  computed as `1 / (1 + Var[rho] / E[rho]^2)` from the two-pass variance, so
  it is exactly 1 when the ratios are equal and never above 1.
  """
  (log_ratio,) = zero_masked(mask, log_ratio)
  ratio = jnp.exp(log_ratio)
  big = jnp.finfo(jnp.float32).max
  mean = masked_mean(ratio, mask)
  variance = segments_lib.masked_variance(ratio, mask, mean)
  return {
      "ratio_mean": mean,
      "ratio_std": jnp.sqrt(variance),
      "ratio_max": jnp.max(jnp.where(mask > 0, ratio, -big)),
      "ratio_min": jnp.min(jnp.where(mask > 0, ratio, big)),
      "ratio_m2": masked_mean(ratio * ratio, mask),
      "ess": 1.0 / (1.0 + variance / jnp.maximum(mean * mean, 1e-30)),
      "abs_log_ratio": masked_mean(jnp.abs(log_ratio), mask),
  }


