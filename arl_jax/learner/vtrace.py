"""V-trace targets over completions (Espeholt et al., 2018, IMPALA, eq. 1).

A completion is one episode with discount 1 and a single reward R at its last
sampled token. Only the tokens the policy sampled (`loss_mask = 1`) are
actions; environment tokens and padding between or after them are skipped by
the recursion, as if the observation were part of the next state. For the
sampled tokens `t_1 < ... < t_n` of a row, with `V_i = V(s_{t_i})`,
`V_{n+1} = 0`, `r_i = R [i = n]`, `rho_i = pi / mu` at `t_i`:

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


def last_token_rewards(rewards, loss_mask):
  """`[B, L]`: each row's scalar reward at its last sampled token, 0 elsewhere."""
  chex.assert_rank([rewards, loss_mask], [1, 2])
  cols = jnp.arange(loss_mask.shape[1])
  last = jnp.max(jnp.where(loss_mask > 0, cols, -1), axis=1)
  return jnp.where(cols[None, :] == last[:, None], rewards[:, None], 0.0)


def vtrace_targets(values, rewards, log_rhos, loss_mask, *, rho_bar: float = 1.0,
                   c_bar: float = 1.0, lam: float = 1.0):
  """V-trace value targets and policy-gradient advantages.

  Args:
    values: `[B, L]` V(s_t) at every column (the critic's estimate of the
      return before the token of that column is sampled).
    rewards: `[B, L]` per-token rewards (see `last_token_rewards`).
    log_rhos: `[B, L]` log pi_theta - log mu (treated as constants).
    loss_mask: `[B, L]`, 1 on the tokens the policy sampled.
    rho_bar, c_bar: truncation levels (rho_bar >= c_bar as in the paper).
    lam: the lambda of the trace.

  Returns:
    `(vs, advantages)`, both `[B, L]` float32, 0 where `loss_mask` is 0;
    stop-gradient (they are targets).
  """
  chex.assert_rank([values, rewards, log_rhos, loss_mask], 2)
  chex.assert_equal_shape([values, rewards, log_rhos, loss_mask])
  values, rewards, log_rhos = jax.lax.stop_gradient((values, rewards, log_rhos))
  rhos = jnp.exp(log_rhos * loss_mask)
  clipped_rho = jnp.minimum(rho_bar, rhos)
  cs = lam * jnp.minimum(c_bar, rhos)

  def step(carry, column):
    next_value, next_correction = carry  # V_{i+1} and v_{i+1} - V_{i+1}
    value, reward, rho_c, c, mask = column
    delta = rho_c * (reward + next_value - value)
    correction = delta + c * next_correction
    advantage = reward + next_value + next_correction - value
    on = mask > 0
    new_carry = (jnp.where(on, value, next_value), jnp.where(on, correction, next_correction))
    return new_carry, (jnp.where(on, value + correction, 0.0), jnp.where(on, advantage, 0.0))

  columns = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).astype(jnp.float32),
                         (values, rewards, clipped_rho, cs, loss_mask))
  zeros = jnp.zeros(values.shape[0], jnp.float32)
  _, (vs, advantages) = jax.lax.scan(step, (zeros, zeros), columns, reverse=True)
  return jnp.swapaxes(vs, 0, 1), jnp.swapaxes(advantages, 0, 1)
