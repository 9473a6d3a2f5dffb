"""V-trace targets over completions (Espeholt et al., 2018, IMPALA, eq. 1).

A completion is one episode with discount 1. Only the tokens the policy
sampled (`loss_mask = 1`) are actions; environment tokens and padding between
or after them are skipped by the recursion, as if the observation were part of
the next state. A reward placed on such a skipped column is therefore earned
by the action before it: `r_i` is the sum of the rewards on the columns from
`t_i` up to (not including) `t_{i+1}`, or to the end of the row for `i = n`
(rewards before `t_1` follow no action of the row and are dropped). With the
usual single reward R at the last sampled token (`last_token_rewards`),
`r_i = R [i = n]`. For the sampled tokens `t_1 < ... < t_n` of a row, with
`V_i = V(s_{t_i})`, `V_{n+1} = 0`, `rho_i = pi / mu` at `t_i`:

  delta_i = min(rho_bar, rho_i) * (r_i + V_{i+1} - V_i)
  v_i     = V_i + delta_i + lambda * min(c_bar, rho_i) * (v_{i+1} - V_{i+1})
  A_i     = r_i + v_{i+1} - V_i        (policy-gradient advantage; the loss
                                        applies the min(rho_bar, rho_i) weight)

With all ratios 1, `rho_bar = c_bar = 1`, `v_i` is the on-policy lambda-return
(`lambda = 1`: the Monte-Carlo return R at every token).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from arl_jax.learner import segments as segments_lib


def last_token_rewards(rewards, loss_mask, segment_ids=None):
  """`[B, L]`: each sequence's reward at its last sampled token, 0 elsewhere.

  `rewards` `[B, L]` holds a sequence's reward on its tokens (a TrainBatch's);
  a sequence is a segment of `segment_ids` (None: each row is one)."""
  chex.assert_rank([rewards, loss_mask], 2)
  if segment_ids is None:
    segment_ids = jnp.ones(loss_mask.shape, jnp.int32)
  return jnp.where(segments_lib.last_marked(loss_mask, segment_ids), rewards, 0.0)


def vtrace_targets(values, rewards, log_rhos, loss_mask, *, rho_bar=1.0, c_bar=1.0,
                   lam: float = 1.0, segment_ids=None):
  """V-trace value targets and policy-gradient advantages.

  Args:
    values: `[B, L]` V(s_t) at every column (the critic's estimate of the
      return before the token of that column is sampled).
    rewards: `[B, L]` per-column rewards (see `last_token_rewards`); a reward
      on a column that is not sampled counts for the last sampled token
      before it (module docstring).
    log_rhos: `[B, L]` log pi_theta - log mu (treated as constants).
    loss_mask: `[B, L]`, 1 on the tokens the policy sampled.
    rho_bar, c_bar: truncation levels (rho_bar >= c_bar as in the paper):
      floats, or `[B, L]` per-token levels (the age-aware trust region,
      `losses.truncation_level`).
    lam: the lambda of the trace.
    segment_ids: optional `[B, L]` (`segments.py`): each segment of a row is
      its own episode, the recursion restarting at its last column (None:
      each row is one).

  Returns:
    `(vs, advantages)`, both `[B, L]` float32, 0 where `loss_mask` is 0;
    stop-gradient (they are targets). Values and log-ratios on columns that
    are not sampled never count, even NaN or inf.
  """
  chex.assert_rank([values, rewards, log_rhos, loss_mask], 2)
  chex.assert_equal_shape([values, rewards, log_rhos, loss_mask])
  for level in (rho_bar, c_bar):
    if jnp.ndim(level):
      chex.assert_equal_shape([level, loss_mask])
  values, rewards, log_rhos = jax.lax.stop_gradient((values, rewards, log_rhos))
  on = loss_mask > 0
  # A `where`, not a product with the mask: `NaN * 0` would still be NaN.
  rhos = jnp.exp(jnp.where(on, log_rhos, 0.0))
  clipped_rho = jnp.minimum(rho_bar, rhos)
  cs = lam * jnp.minimum(c_bar, rhos)

  def step(carry, column):
    # V_{i+1}, v_{i+1} - V_{i+1}, and the rewards of the skipped columns
    # since t_i (they belong to r_i, discount 1); nothing of them crosses
    # into an earlier segment.
    value, reward, rho_c, c, on, end = column
    next_value, next_correction, pending = jax.tree.map(
        lambda x: jnp.where(end, 0.0, x), carry)
    reward = reward + pending
    delta = rho_c * (reward + next_value - value)
    correction = delta + c * next_correction
    advantage = reward + next_value + next_correction - value
    new_carry = (jnp.where(on, value, next_value), jnp.where(on, correction, next_correction),
                 jnp.where(on, 0.0, reward))
    return new_carry, (jnp.where(on, value + correction, 0.0), jnp.where(on, advantage, 0.0))

  ends = (jnp.zeros(on.shape, bool) if segment_ids is None
          else segments_lib.ends(segment_ids))
  columns = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1),
                         (values.astype(jnp.float32), rewards.astype(jnp.float32),
                          clipped_rho.astype(jnp.float32), cs.astype(jnp.float32), on, ends))
  zeros = jnp.zeros(values.shape[0], jnp.float32)
  _, (vs, advantages) = jax.lax.scan(step, (zeros, zeros, zeros), columns, reverse=True)
  return jnp.swapaxes(vs, 0, 1), jnp.swapaxes(advantages, 0, 1)
