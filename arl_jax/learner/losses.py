"""Token-level policy losses against recorded behaviour log-probabilities.

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
op (`_zero_masked`) and selects with `jnp.where`, so they reach neither the
loss nor its gradient nor the metrics. Multiplying by the mask would not do:
`NaN * 0` is NaN, and so is the cotangent `0 * exp(NaN)` of a `where` placed
only on the output.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from arl_jax.learner import mismatch as mismatch_lib
from arl_jax.learner import segments as segments_lib

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")


masked_mean = segments_lib.masked_mean


def _zero_masked(loss_mask, *arrays):
  """Each array with 0 on the columns `loss_mask` leaves out (None stays None).

  Applied to a loss's inputs before any nonlinear op: the gradient of
  `where(on, x, 0)` is exactly 0 off the mask, whatever x held there."""
  on = loss_mask > 0
  return tuple(None if x is None else jnp.where(on, x, jnp.zeros_like(x)) for x in arrays)


def _check(logprobs, behaviour_logprobs, advantages, loss_mask, *optional):
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


def _age_scale(token_lag, age_decay: float):
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
  return jnp.minimum(bar, 1.0 + (bar - 1.0) * _age_scale(token_lag, age_decay))


def _trust_region_log_ratio(logprobs, behaviour_logprobs, loss_mask, proximal_logprobs,
                            correction: mismatch_lib.Correction | None, segment_ids):
  """`(log r, w, metrics)`: the log of the ratio the trust region acts on, and
  the constant off-policy weight (see the module docstring). Inputs are
  already 0 off the mask (`_zero_masked`), so `log r` is 0 there and `w` 0."""
  if proximal_logprobs is None:
    if correction is not None and correction.is_on:
      raise ValueError("a mismatch correction weighs pi_prox / mu: it needs proximal_logprobs "
                       "(the decoupled objective)")
    return logprobs - behaviour_logprobs, 1.0, {}
  w, metrics = mismatch_lib.behaviour_weights(proximal_logprobs - behaviour_logprobs, loss_mask,
                                              correction, segment_ids)
  return logprobs - proximal_logprobs, w, metrics


def _clipped_surrogate(r, advantages, loss_mask, token_lag, eps_low, eps_high, age_decay, w,
                       metrics, dual_clip=None):
  """The clipped surrogate's per-token loss `-w * min(r A, clip(r) A)` of
  ratios `r` `[B, L]` (each token's own: `clipped_ratio`; its sequence's:
  the GSPO losses), with the dual clip when `dual_clip` is set, and the
  fraction of tokens whose clipped branch is the active one."""
  scale = _age_scale(token_lag, age_decay)
  clipped = jnp.clip(r, 1.0 - eps_low * scale, 1.0 + eps_high * scale)
  surrogate = jnp.minimum(r * advantages, clipped * advantages)
  if dual_clip is not None:
    surrogate = jnp.where(advantages < 0, jnp.maximum(surrogate, dual_clip * advantages),
                          surrogate)
  metrics["clip_fraction"] = masked_mean((r * advantages > clipped * advantages)
                                         .astype(jnp.float32), loss_mask)
  return jnp.where(loss_mask > 0, -w * surrogate, 0.0), metrics


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
  _check(logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag)
  logprobs, behaviour_logprobs, advantages, proximal_logprobs = _zero_masked(
      loss_mask, logprobs, behaviour_logprobs, advantages, proximal_logprobs)
  log_r, w, metrics = _trust_region_log_ratio(logprobs, behaviour_logprobs, loss_mask,
                                              proximal_logprobs, correction, segment_ids)
  return _clipped_surrogate(jnp.exp(log_r), advantages, loss_mask, token_lag, eps_low,
                            eps_high, age_decay, w, metrics, dual_clip=dual_clip)


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
  proximal policy. With `age_decay`, `rho_bar_t = truncation_level(rho_bar,
  lag_t, age_decay)`.
  """
  del segment_ids  # (token-level)
  _check(logprobs, behaviour_logprobs, advantages, loss_mask, token_lag)
  if proximal_logprobs is not None:
    raise ValueError("vtrace corrects against the behaviour policy; it takes no proximal policy")
  logprobs, behaviour_logprobs, advantages = _zero_masked(loss_mask, logprobs,
                                                          behaviour_logprobs, advantages)
  rho = jnp.exp(jax.lax.stop_gradient(logprobs - behaviour_logprobs))
  level = truncation_level(rho_bar, token_lag, age_decay)
  truncated = jnp.minimum(rho, level)
  metrics = {"clip_fraction": masked_mean((rho > level).astype(jnp.float32), loss_mask)}
  return jnp.where(loss_mask > 0, -truncated * advantages * logprobs, 0.0), metrics


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
  _check(logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag)
  logprobs, behaviour_logprobs, advantages, proximal_logprobs = _zero_masked(
      loss_mask, logprobs, behaviour_logprobs, advantages, proximal_logprobs)
  log_r, w, metrics = _trust_region_log_ratio(logprobs, behaviour_logprobs, loss_mask,
                                              proximal_logprobs, correction, segment_ids)
  r = jnp.exp(log_r)
  log_ratio = jax.lax.stop_gradient(logprobs - behaviour_logprobs)
  if keep is None:
    keep = m2po_keep_mask(log_ratio, loss_mask, tau)
  else:
    chex.assert_equal_shape([keep, loss_mask])
    keep = keep * loss_mask
  metrics["masked_fraction"] = masked_mean(1.0 - keep, loss_mask)
  metrics["m2_kept"] = masked_mean(jnp.square(log_ratio), keep)
  return jnp.where(keep > 0, -w * r * advantages, 0.0), metrics


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
  _check(logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag)
  logprobs, behaviour_logprobs, advantages, proximal_logprobs = _zero_masked(
      loss_mask, logprobs, behaviour_logprobs, advantages, proximal_logprobs)
  log_r, w, metrics = _trust_region_log_ratio(logprobs, behaviour_logprobs, loss_mask,
                                              proximal_logprobs, correction, segment_ids)
  r = jnp.exp(jax.lax.stop_gradient(log_r))
  scale = _age_scale(token_lag, age_decay)
  low, high = 1.0 - eps_low * scale, 1.0 + eps_high * scale
  metrics["clip_fraction"] = masked_mean(((r < low) | (r > high)).astype(jnp.float32),
                                         loss_mask)
  weight = jnp.clip(r, low, high)
  return jnp.where(loss_mask > 0, -w * weight * advantages * logprobs, 0.0), metrics


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
  _check(logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag)
  logprobs, behaviour_logprobs, advantages, proximal_logprobs = _zero_masked(
      loss_mask, logprobs, behaviour_logprobs, advantages, proximal_logprobs)
  log_r, w, metrics = _trust_region_log_ratio(logprobs, behaviour_logprobs, loss_mask,
                                              proximal_logprobs, correction, segment_ids)
  s = jnp.exp(segments_lib.sequence_means(log_r, loss_mask, segment_ids))
  return _clipped_surrogate(s, advantages, loss_mask, token_lag, eps_low, eps_high, age_decay, w,
                         metrics)


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
  _check(logprobs, behaviour_logprobs, advantages, loss_mask, proximal_logprobs, token_lag)
  logprobs, behaviour_logprobs, advantages, proximal_logprobs = _zero_masked(
      loss_mask, logprobs, behaviour_logprobs, advantages, proximal_logprobs)
  log_r, w, metrics = _trust_region_log_ratio(logprobs, behaviour_logprobs, loss_mask,
                                              proximal_logprobs, correction, segment_ids)
  log_s = jax.lax.stop_gradient(segments_lib.sequence_means(log_r, loss_mask, segment_ids))
  s = jnp.exp(log_s + logprobs - jax.lax.stop_gradient(logprobs))
  return _clipped_surrogate(s, advantages, loss_mask, token_lag, eps_low, eps_high, age_decay, w,
                         metrics)


def kl_to_reference(logprobs, reference_logprobs, loss_mask):
  """Per-token k3 estimate of KL(pi_theta || pi_ref) (Schulman, 2020), as GRPO:
  with `log q = logp_ref - logp_theta`, `exp(log q) - log q - 1 >= 0`."""
  chex.assert_equal_shape([logprobs, reference_logprobs, loss_mask])
  logprobs, reference_logprobs = _zero_masked(loss_mask, logprobs, reference_logprobs)
  log_q = reference_logprobs - logprobs
  return jnp.where(loss_mask > 0, jnp.exp(log_q) - log_q - 1.0, 0.0)


def ratio_statistics(log_ratio, mask):
  """Importance-ratio statistics over masked tokens: the signal to watch as lag grows.

  `ratio_m2` is `E[rho^2]`; `ess` is the normalised effective sample size
  `E[rho]^2 / E[rho^2]` (1 on-policy, toward 0 as the weights degenerate),
  computed as `1 / (1 + Var[rho] / E[rho]^2)` from the two-pass variance, so
  it is exactly 1 when the ratios are equal and never above 1.
  """
  (log_ratio,) = _zero_masked(mask, log_ratio)
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


LOSSES = {"clipped_ratio": clipped_ratio, "vtrace": vtrace, "m2po": m2po, "cispo": cispo,
          "gspo": gspo, "gspo_token": gspo_token}
