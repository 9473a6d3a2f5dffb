"""Golden numbers for the token losses (hand-computed), jitted and not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl_jax.learner import advantages as advantages_lib
from arl_jax.learner import losses

LOGP = np.array([[-1.0, -2.0, -0.5], [-0.5, -1.3, -9.0]], np.float32)
BEHAVIOUR = np.array([[-1.2, -1.5, -0.5], [-1.0, -1.0, -1.0]], np.float32)
ADV = np.array([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)


@pytest.mark.parametrize("jit", [False, True])
def test_clipped_ratio_golden(jit):
  # Ratios: row 0 e^0.2, e^-0.5, 1; row 1 e^0.5, e^-0.3 (third token masked).
  # Per-token -min(rA, clip(r, 0.8, 1.2) A):
  #   row 0 (A=2):  -2.4, -2*e^-0.5 = -1.2130613, -2
  #   row 1 (A=-1): e^0.5 = 1.6487213, 0.8
  expected = (-2.4 - 1.2130613 - 2.0 + 1.6487213 + 0.8) / 5
  fn = jax.jit(losses.clipped_ratio) if jit else losses.clipped_ratio
  loss, metrics = fn(LOGP, BEHAVIOUR, ADV, MASK)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_fraction"], 2 / 5, rtol=1e-6)
  ratios = np.exp([0.2, -0.5, 0.0, 0.5, -0.3])
  np.testing.assert_allclose(metrics["ratio_mean"], ratios.mean(), rtol=1e-6)
  np.testing.assert_allclose(metrics["ratio_max"], np.exp(0.5), rtol=1e-6)
  np.testing.assert_allclose(metrics["ratio_min"], np.exp(-0.5), rtol=1e-6)
  np.testing.assert_allclose(metrics["ratio_m2"], (ratios ** 2).mean(), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_clipped_ratio_dual_clip_caps_negative_advantage_loss(jit):
  # With c = 1.5 the row-1 token with ratio e^0.5 is capped at -c A = 1.5.
  expected = (-2.4 - 1.2130613 - 2.0 + 1.5 + 0.8) / 5
  fn = jax.jit(losses.clipped_ratio, static_argnames=("dual_clip",)) if jit else losses.clipped_ratio
  loss, _ = fn(LOGP, BEHAVIOUR, ADV, MASK, dual_clip=1.5)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_clipped_ratio_asymmetric_clip():
  # eps_high = 0.1: row 0 token 0 is clipped at 1.1 instead of 1.2.
  loss, _ = losses.clipped_ratio(LOGP[:1], BEHAVIOUR[:1], ADV[:1], MASK[:1], eps_high=0.1)
  np.testing.assert_allclose(loss, (-2.2 - 1.2130613 - 2.0) / 3, rtol=1e-6)


def test_on_policy_gradient_is_the_policy_gradient():
  # At ratio 1 the gradient w.r.t. logp is -A / num_tokens on every token.
  grad = jax.grad(lambda lp: losses.clipped_ratio(lp, LOGP, ADV, MASK)[0])(jnp.asarray(LOGP))
  np.testing.assert_allclose(grad, -ADV * MASK / MASK.sum(), rtol=1e-6)


def test_shape_mismatch_is_rejected():
  with pytest.raises(AssertionError):
    losses.clipped_ratio(LOGP, BEHAVIOUR[:, :2], ADV, MASK)
  with pytest.raises(AssertionError):
    losses.clipped_ratio(LOGP[0], BEHAVIOUR[0], ADV[0], MASK[0])


def test_grpo_advantages():
  rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
  adv = advantages_lib.group_advantages(rewards, "grpo")
  np.testing.assert_allclose(adv[0], [1, -1, -1, 1], atol=1e-5)
  np.testing.assert_allclose(adv[1], 0.0)  # a constant group carries no signal, no NaN
  no_std = advantages_lib.group_advantages(rewards, "grpo_no_std")
  np.testing.assert_allclose(no_std[0], [0.5, -0.5, -0.5, 0.5])
  with pytest.raises(ValueError, match="rewards must be"):
    advantages_lib.group_advantages(rewards[0], "grpo")



def test_grpo_advantages_ignore_errored_rollouts():
  rewards = np.array([[1.0, 0.0, 1.0, 0.0]], np.float32)
  valid = np.array([[True, False, True, True]])
  adv = advantages_lib.group_advantages(rewards, "grpo", valid=valid)
  # Statistics over [1, 1, 0] only: mean 2/3, std sqrt(2)/3.
  np.testing.assert_allclose(adv[0], [1 / np.sqrt(2), 0.0, 1 / np.sqrt(2), -np.sqrt(2)],
                             rtol=1e-5)
