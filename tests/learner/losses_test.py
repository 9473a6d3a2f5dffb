"""Golden numbers for the token losses, aggregation, V-trace and advantages
(hand-computed in the comments), jitted and not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl_jax.core import advantages as advantages_lib
from arl_jax.learner import loss_registry, losses, mismatch
from arl_jax.learner import vtrace as vtrace_lib
from arl_jax.learner.objectives import clipped_ratio as clipped_ratio_lib
from arl_jax.learner.objectives import m2po as m2po_lib
from arl_jax.learner.objectives import vtrace as vtrace_loss_lib

LOGP = np.array([[-1.0, -2.0, -0.5], [-0.5, -1.3, -9.0]], np.float32)
BEHAVIOUR = np.array([[-1.2, -1.5, -0.5], [-1.0, -1.0, -1.0]], np.float32)
ADV = np.array([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)  # the last token is padding


def maybe_jit(fn, jit, **static):
  fn = functools.partial(fn, **static)
  return jax.jit(fn) if jit else fn


@pytest.mark.parametrize("jit", [False, True])
def test_clipped_ratio_golden(jit):
  # Ratios: row 0 e^0.2, e^-0.5, 1; row 1 e^0.5, e^-0.3 (third token masked).
  # Per-token -min(rA, clip(r, 0.8, 1.2) A):
  #   row 0 (A=2):  -2.4, -2*e^-0.5 = -1.2130613, -2
  #   row 1 (A=-1): e^0.5 = 1.6487213, 0.8
  per_token, metrics = maybe_jit(clipped_ratio_lib.clipped_ratio, jit)(LOGP, BEHAVIOUR, ADV, MASK)
  np.testing.assert_allclose(per_token, [[-2.4, -1.2130613, -2.0], [1.6487213, 0.8, 0.0]],
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_fraction"], 2 / 5, rtol=1e-6)


def test_clipped_ratio_dual_clip_and_asymmetric_clip():
  # Dual clip c = 1.5 caps the row-1 token with ratio e^0.5 at -c A = 1.5.
  per_token, _ = clipped_ratio_lib.clipped_ratio(LOGP, BEHAVIOUR, ADV, MASK, dual_clip=1.5)
  np.testing.assert_allclose(per_token[1], [1.5, 0.8, 0.0], rtol=1e-6)
  # eps_high = 0.1: row 0 token 0 is clipped at 1.1 instead of 1.2.
  per_token, _ = clipped_ratio_lib.clipped_ratio(LOGP, BEHAVIOUR, ADV, MASK, eps_high=0.1)
  np.testing.assert_allclose(per_token[0], [-2.2, -1.2130613, -2.0], rtol=1e-6)


def test_age_aware_trust_region_shrinks_the_clip_range_with_lag():
  # Token lags 0, 1, 3 with age_decay 1: eps 0.2, 0.1, 0.05.
  logp = np.array([[0.3, 0.3, 0.3]], np.float32)  # ratio e^0.3 = 1.3499 everywhere
  lag = np.array([[0, 1, 3]], np.int32)
  ones = np.ones((1, 3), np.float32)
  per_token, metrics = clipped_ratio_lib.clipped_ratio(logp, 0 * ones, ones, ones, token_lag=lag,
                                            age_decay=1.0)
  np.testing.assert_allclose(per_token, [[-1.2, -1.1, -1.05]], rtol=1e-6)
  off, _ = clipped_ratio_lib.clipped_ratio(logp, 0 * ones, ones, ones, token_lag=lag)
  np.testing.assert_allclose(off, [[-1.2, -1.2, -1.2]], rtol=1e-6)
  assert float(metrics["clip_fraction"]) == 1.0


@pytest.mark.parametrize("jit", [False, True])
def test_decoupled_objective_and_truncated_importance_weight(jit):
  # pi_prox / mu = e^{0.2} and e^{1.0}; the trust region is around pi_prox.
  behaviour = np.array([[-1.2, -2.0]], np.float32)
  proximal = np.array([[-1.0, -1.0]], np.float32)
  logp = np.array([[-0.7, -1.0]], np.float32)  # r = e^0.3 (clipped at 1.2), 1
  adv = np.ones((1, 2), np.float32)
  mask = np.ones((1, 2), np.float32)
  fn = maybe_jit(clipped_ratio_lib.clipped_ratio, jit)
  per_token, metrics = fn(logp, behaviour, adv, mask, proximal_logprobs=proximal)
  np.testing.assert_allclose(per_token, [[-1.2 * np.exp(0.2), -np.exp(1.0)]], rtol=1e-6)
  fn = maybe_jit(clipped_ratio_lib.clipped_ratio, jit, correction=mismatch.Correction(tis_cap=2.0))
  per_token, metrics = fn(logp, behaviour, adv, mask, proximal_logprobs=proximal)
  np.testing.assert_allclose(per_token, [[-1.2 * np.exp(0.2), -2.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["tis_truncated_fraction"], 0.5)


def test_a_lagged_token_is_reweighted_by_its_own_recorded_probability():
  """One rollout spanning versions: each token's gradient weight is exactly
  pi_theta(a_t) / mu_t with mu_t the probability recorded when it was sampled."""
  logp = jnp.log(jnp.array([[0.5, 0.4, 0.3]], jnp.float32))
  recorded = np.log(np.array([[0.5, 0.2, 0.6]], np.float32))  # versions 9, 10, 11
  adv = np.ones((1, 3), np.float32)
  mask = np.ones((1, 3), np.float32)
  # Inside the clip range (eps huge): d loss_t / d logp_t = -rho_t A.
  grad = jax.grad(lambda lp: jnp.sum(clipped_ratio_lib.clipped_ratio(
      lp, recorded, adv, mask, eps_low=0.99, eps_high=100.0)[0]))(logp)
  np.testing.assert_allclose(grad, -np.array([[0.5 / 0.5, 0.4 / 0.2, 0.3 / 0.6]]), rtol=1e-6)
  # V-trace weights the same tokens by min(rho, rho_bar).
  grad = jax.grad(lambda lp: jnp.sum(vtrace_loss_lib.vtrace(lp, recorded, adv, mask, rho_bar=1.5)[0]))(
      logp)
  np.testing.assert_allclose(grad, -np.array([[1.0, 1.5, 0.5]]), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_vtrace_policy_loss_golden(jit):
  # rho = e^0.2, e^-0.5, 1 | e^0.5, e^-0.3; truncated at 1: 1, e^-0.5, 1 | 1, e^-0.3.
  per_token, metrics = maybe_jit(vtrace_loss_lib.vtrace, jit)(LOGP, BEHAVIOUR, ADV, MASK)
  expected = -np.array([[1.0, np.exp(-0.5), 1.0], [1.0, np.exp(-0.3), 0.0]]) * ADV * LOGP
  np.testing.assert_allclose(per_token, expected * MASK, rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_fraction"], 2 / 5, rtol=1e-6)


def test_m2po_mask_drops_the_largest_second_moments_until_the_mean_is_below_tau():
  # log-ratios^2: 0.01, 0.04, 0.09, 0.25 (+ one padded). Prefix means ascending:
  # 0.01, 0.025, 0.0467, 0.0975 -> with tau = 0.04 keep the two smallest.
  log_ratio = jnp.array([[0.1, -0.3, 0.5], [0.2, 9.0, 0.0]], jnp.float32)
  mask = jnp.array([[1, 1, 1], [1, 0, 0]], jnp.float32)
  keep = m2po_lib.m2po_keep_mask(log_ratio, mask, 0.04)
  np.testing.assert_array_equal(keep, [[1, 0, 0], [1, 0, 0]])
  np.testing.assert_array_equal(m2po_lib.m2po_keep_mask(log_ratio, mask, 1.0), mask)


@pytest.mark.parametrize("jit", [False, True])
def test_m2po_golden(jit):
  # log-ratios 0.2, -0.5, 0 | 0.5, -0.3; squares 0.04, 0.25, 0 | 0.25, 0.09.
  # Ascending 0, 0.04, 0.09, 0.25, 0.25: prefix means 0, 0.02, 0.0433, ... -> keep 2
  # (tau 0.04): tokens (0, 2) and (0, 0). Loss -r A on them: -2, -2 e^0.2.
  per_token, metrics = maybe_jit(m2po_lib.m2po, jit)(LOGP, BEHAVIOUR, ADV, MASK)
  np.testing.assert_allclose(per_token, [[-2 * np.exp(0.2), 0, -2.0], [0, 0, 0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["masked_fraction"], 3 / 5, rtol=1e-6)
  np.testing.assert_allclose(metrics["m2_kept"], 0.02, rtol=1e-5)


def test_token_weights_aggregations():
  # Row 0 has 3 trained tokens, row 1 has 2, row 2 none.
  mask = jnp.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]], jnp.float32)
  np.testing.assert_allclose(losses.token_weights(mask, "token_mean"), mask / 5)
  np.testing.assert_allclose(losses.token_weights(mask, "seq_mean_token_mean"),
                             [[1 / 6] * 3, [1 / 4, 1 / 4, 0], [0, 0, 0]], rtol=1e-6)
  np.testing.assert_allclose(losses.token_weights(mask, "seq_sum_norm", norm_constant=10.0),
                             mask / 20)
  with pytest.raises(ValueError, match="norm_constant"):
    losses.token_weights(mask, "seq_sum_norm")


def test_on_policy_gradient_is_the_policy_gradient():
  # At ratio 1 with token-mean weights the gradient is -A / num_tokens on every token.
  weights = losses.token_weights(jnp.asarray(MASK), "token_mean")
  grad = jax.grad(lambda lp: jnp.sum(weights * clipped_ratio_lib.clipped_ratio(lp, LOGP, ADV, MASK)[0]))(
      jnp.asarray(LOGP))
  np.testing.assert_allclose(grad, -ADV * MASK / MASK.sum(), rtol=1e-6)


def test_kl_to_reference_and_ratio_statistics():
  ref = np.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], np.float32)
  kl = losses.kl_to_reference(LOGP, ref, MASK)
  log_q = (ref - LOGP) * MASK
  np.testing.assert_allclose(kl, (np.exp(log_q) - log_q - 1) * MASK, rtol=1e-6)
  assert np.all(np.asarray(kl) >= 0)
  stats = losses.ratio_statistics((LOGP - BEHAVIOUR) * MASK, MASK)
  ratios = np.exp([0.2, -0.5, 0.0, 0.5, -0.3])
  np.testing.assert_allclose(stats["ratio_mean"], ratios.mean(), rtol=1e-6)
  np.testing.assert_allclose(stats["ratio_max"], np.exp(0.5), rtol=1e-6)
  np.testing.assert_allclose(stats["ratio_min"], np.exp(-0.5), rtol=1e-6)
  np.testing.assert_allclose(stats["ratio_m2"], (ratios ** 2).mean(), rtol=1e-6)
  np.testing.assert_allclose(stats["ess"], ratios.mean() ** 2 / (ratios ** 2).mean(), rtol=1e-6)


def test_ratio_spread_is_exact_near_one_and_ess_never_passes_one():
  """Ratios near 1 with a small spread (lag 0: the trainer/sampler mismatch):
  `E[r^2] - E[r]^2` in float32 cancelled to noise (a std off by tens of
  percent, an ESS above 1); the two-pass spread matches float64."""
  rng = np.random.default_rng(0)
  for scale in (0.0, 1e-4, 1e-3, 1e-2):
    log_r = (scale * rng.standard_normal((8, 64))).astype(np.float32)
    mask = (rng.random((8, 64)) < 0.8).astype(np.float32)
    stats = losses.ratio_statistics(jnp.asarray(log_r), jnp.asarray(mask))
    ratios = np.exp(log_r.astype(np.float64))[mask > 0]
    np.testing.assert_allclose(stats["ratio_std"], ratios.std(), rtol=2e-3, atol=1e-7)
    np.testing.assert_allclose(stats["ess"], ratios.mean() ** 2 / (ratios ** 2).mean(),
                               rtol=1e-6)
    assert float(stats["ess"]) <= 1.0
    if scale == 0.0:
      assert float(stats["ratio_std"]) == 0.0 and float(stats["ess"]) == 1.0


def test_shape_mismatch_is_rejected():
  with pytest.raises(AssertionError):
    clipped_ratio_lib.clipped_ratio(LOGP, BEHAVIOUR[:, :2], ADV, MASK)
  with pytest.raises(AssertionError):
    clipped_ratio_lib.clipped_ratio(LOGP[0], BEHAVIOUR[0], ADV[0], MASK[0])
  with pytest.raises(ValueError, match="no proximal"):
    vtrace_loss_lib.vtrace(LOGP, BEHAVIOUR, ADV, MASK, proximal_logprobs=LOGP)


@pytest.mark.parametrize("jit", [False, True])
def test_vtrace_targets_hand_checked(jit):
  """Three sampled tokens with an environment token and padding in between:
  V = 0.5, 0.2, 0.9; rho = 2, 0.5, 1; R = 1; rho_bar = c_bar = 1; lambda 0.9.

    i=3: delta = 1 * (1 + 0 - 0.9) = 0.1;  v3 = 1.0;  A3 = 1 + 0 - 0.9 = 0.1
    i=2: delta = 0.5 * (0 + 0.9 - 0.2) = 0.35
         v2 = 0.2 + 0.35 + 0.9 * 0.5 * (1.0 - 0.9) = 0.595;  A2 = 1.0 - 0.2 = 0.8
    i=1: delta = 1 * (0 + 0.2 - 0.5) = -0.3
         v1 = 0.5 - 0.3 + 0.9 * 1 * (0.595 - 0.2) = 0.5555;  A1 = 0.595 - 0.5 = 0.095
  """
  mask = np.array([[1, 1, 0, 1, 0]], np.float32)
  values = np.array([[0.5, 0.2, 7.0, 0.9, 3.0]], np.float32)  # 7 and 3 must not matter
  log_rhos = np.log(np.array([[2.0, 0.5, 5.0, 1.0, 5.0]], np.float32))
  rewards = vtrace_lib.last_token_rewards(np.ones_like(mask), mask)
  np.testing.assert_array_equal(rewards, [[0, 0, 0, 1, 0]])
  fn = maybe_jit(vtrace_lib.vtrace_targets, jit, lam=0.9)
  vs, adv = fn(values, rewards, log_rhos, mask)
  np.testing.assert_allclose(vs, [[0.5555, 0.595, 0.0, 1.0, 0.0]], rtol=1e-5)
  np.testing.assert_allclose(adv, [[0.095, 0.8, 0.0, 0.1, 0.0]], rtol=1e-5, atol=1e-7)


def test_vtrace_on_policy_equals_the_lambda_return():
  rng = np.random.default_rng(0)
  b, length, lam = 4, 7, 0.8
  mask = (rng.random((b, length)) < 0.8).astype(np.float32)
  mask[:, 0] = 1
  values = rng.normal(size=(b, length)).astype(np.float32)
  rewards = vtrace_lib.last_token_rewards(
      np.broadcast_to(rng.normal(size=(b, 1)), mask.shape).astype(np.float32), mask)
  vs, _ = vtrace_lib.vtrace_targets(values, rewards, np.zeros((b, length), np.float32), mask,
                                    lam=lam)
  for row in range(b):  # G_i = r_i + (1 - lam) V_{i+1} + lam G_{i+1}, discount 1
    idx = np.flatnonzero(mask[row])
    g, expected = 0.0, {}
    for j in reversed(range(len(idx))):
      next_v = values[row, idx[j + 1]] if j + 1 < len(idx) else 0.0
      g = rewards[row, idx[j]] + (1 - lam) * next_v + lam * g
      expected[idx[j]] = g
    np.testing.assert_allclose([vs[row, i] for i in idx], [expected[i] for i in idx],
                               rtol=1e-5)
  # lambda = 1: the Monte-Carlo return R at every sampled token.
  vs1, _ = vtrace_lib.vtrace_targets(values, rewards, np.zeros_like(values), mask, lam=1.0)
  np.testing.assert_allclose(vs1 * mask, rewards.sum(axis=1, keepdims=True) * mask, rtol=1e-5)


def test_grpo_advantages():
  rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
  adv = advantages_lib.group_advantages(rewards, "grpo")
  np.testing.assert_allclose(adv[0], [1, -1, -1, 1], atol=1e-5)
  np.testing.assert_allclose(adv[1], 0.0)  # a constant group carries no signal, no NaN
  no_std = advantages_lib.group_advantages(rewards, "grpo_no_std")
  np.testing.assert_allclose(no_std[0], [0.5, -0.5, -0.5, 0.5])
  with pytest.raises(ValueError, match="rewards must be"):
    advantages_lib.group_advantages(rewards[0], "grpo")


def test_rloo_advantages_leave_one_out():
  rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 0.0]], np.float32)
  adv = advantages_lib.group_advantages(rewards, "rloo")
  # r_i - mean of the other three.
  np.testing.assert_allclose(adv[0], [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3], rtol=1e-6)
  np.testing.assert_allclose(adv[1], [3 - 1, 1 - 5 / 3, 2 - 4 / 3, 0 - 2], rtol=1e-6)
  valid = np.array([[True, False, False, True], [True, True, True, True]])
  adv = advantages_lib.group_advantages(rewards[:1], "rloo", valid=valid[:1])
  np.testing.assert_allclose(adv[0], [0, 0, 0, 0])  # 1 - 1, invalid, invalid, 1 - 1
  lonely = advantages_lib.group_advantages(rewards[:1], "rloo",
                                           valid=np.array([[True, False, False, False]]))
  np.testing.assert_allclose(lonely, 0.0)  # no baseline without another rollout


def test_grpo_advantages_ignore_errored_rollouts():
  rewards = np.array([[1.0, 0.0, 1.0, 0.0]], np.float32)
  valid = np.array([[True, False, True, True]])
  adv = advantages_lib.group_advantages(rewards, "grpo", valid=valid)
  # Statistics over [1, 1, 0] only: mean 2/3, std sqrt(2)/3.
  np.testing.assert_allclose(adv[0], [1 / np.sqrt(2), 0.0, 1 / np.sqrt(2), -np.sqrt(2)],
                             rtol=1e-5)


def test_reinforce_pp_advantages_are_normalised_over_the_batch():
  rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
  # No baseline: batch mean 0.75, std sqrt(1.5 / 8) = 0.4330127; a group of
  # equal rewards still gets (1 - 0.75) / 0.433 = 0.5773503.
  adv = advantages_lib.group_advantages(rewards, "reinforce_pp")
  np.testing.assert_allclose(adv, [[0.5773503, -1.7320508, -1.7320508, 0.5773503],
                                   [0.5773503] * 4], rtol=1e-5)
  # Group mean first (+-0.5 and 0), then the batch's std sqrt(1 / 8) = 0.3535534.
  adv = advantages_lib.group_advantages(rewards, "reinforce_pp_baseline")
  np.testing.assert_allclose(adv, [[1.4142135, -1.4142135, -1.4142135, 1.4142135], [0.0] * 4],
                             rtol=1e-5)
  # Invalid rollouts enter no statistic and get 0: the batch is the 7 valid ones.
  valid = np.array([[True, False, True, True], [True] * 4])
  adv = advantages_lib.group_advantages(rewards, "reinforce_pp", valid=valid)
  kept = np.array([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
  expected = (kept - kept.mean()) / (kept.std() + 1e-6)
  np.testing.assert_allclose(adv[valid], expected, rtol=1e-5)
  assert adv[0, 1] == 0.0


# Masked columns holding NaN and inf: (0, 0) and (0, 3) of row 0, (1, 2) and
# (1, 3) of row 1 (a prompt column, padding, an errored token).
WIDE_MASK = np.array([[0, 1, 1, 0], [1, 1, 0, 0]], np.float32)
POISON = np.array([[np.nan, 0, 0, np.inf], [0, 0, -np.inf, np.nan]], np.float32)


def _poisoned(x):
  return np.where(WIDE_MASK > 0, x, POISON).astype(np.float32)


def _wide_inputs():
  rng = np.random.default_rng(3)
  logp = rng.normal(-1.0, 0.3, (2, 4)).astype(np.float32)
  return {"logprobs": logp,
          "behaviour_logprobs": (logp + rng.normal(0, 0.4, (2, 4))).astype(np.float32),
          "proximal_logprobs": (logp + rng.normal(0, 0.2, (2, 4))).astype(np.float32),
          "advantages": rng.normal(size=(2, 4)).astype(np.float32),
          "reference": (logp + rng.normal(0, 0.3, (2, 4))).astype(np.float32)}


@pytest.mark.parametrize("name,knobs", [
    ("clipped_ratio", dict(dual_clip=3.0)),
    ("clipped_ratio", dict(proximal=True, correction=mismatch.Correction(tis_cap=1.2),
                           age_decay=0.5)),
    ("vtrace", dict(rho_bar=1.2, age_decay=0.5)),
    ("m2po", dict(tau=0.1)),
    ("m2po", dict(proximal=True, correction=mismatch.Correction(tis_cap=1.2))),
    ("cispo", dict(proximal=True, age_decay=0.5,
                   correction=mismatch.Correction(mismatch_mask="token", mismatch_low=0.9))),
    ("gspo", dict(proximal=True, eps_low=0.05, eps_high=0.05,
                  correction=mismatch.Correction(seq_tis_cap=1.1, mismatch_mask="sequence",
                                                 mismatch_low=0.9, mismatch_high=1.1))),
    ("gspo_token", dict(eps_low=0.05, eps_high=0.05)),
])
@pytest.mark.parametrize("jit", [False, True])
def test_nan_and_inf_on_masked_columns_reach_no_loss_metric_or_gradient(name, knobs, jit):
  """Every input that is not the mask holds NaN or inf off the mask: the
  per-token loss, the KL term, the metrics and the gradient are exactly those
  of finite inputs."""
  knobs = dict(knobs)
  with_proximal = knobs.pop("proximal", False)
  lag = np.array([[5, 1, 3, 9], [0, 2, 4, 1]], np.int32)
  if "age_decay" in knobs:
    knobs["token_lag"] = lag

  def run(inputs):
    def objective(logp):
      per_token, metrics = loss_registry.LOSSES[name].fn(
          logp, inputs["behaviour_logprobs"], inputs["advantages"], WIDE_MASK,
          proximal_logprobs=inputs["proximal_logprobs"] if with_proximal else None, **knobs)
      kl = losses.kl_to_reference(logp, inputs["reference"], WIDE_MASK)
      weights = losses.token_weights(jnp.asarray(WIDE_MASK), "token_mean")
      return jnp.sum(weights * (per_token + 0.1 * kl)), (per_token, kl, metrics)
    fn = jax.value_and_grad(objective, has_aux=True)  # (knobs are closed over: static)
    (loss, aux), grad = (jax.jit(fn) if jit else fn)(jnp.asarray(inputs["logprobs"]))
    return loss, aux, grad

  clean = _wide_inputs()
  loss, (per_token, kl, metrics), grad = run(clean)
  assert np.isfinite(loss) and np.all(np.asarray(per_token)[WIDE_MASK == 0] == 0)
  bad_loss, (bad_per_token, bad_kl, bad_metrics), bad_grad = run(
      {k: _poisoned(v) for k, v in clean.items()})
  np.testing.assert_array_equal(bad_loss, loss)
  np.testing.assert_array_equal(bad_per_token, per_token)
  np.testing.assert_array_equal(bad_kl, kl)
  np.testing.assert_array_equal(bad_grad, grad)
  assert set(bad_metrics) == set(metrics)
  for key in metrics:
    np.testing.assert_array_equal(bad_metrics[key], metrics[key], err_msg=key)


def test_ratio_statistics_and_masked_mean_ignore_nan_and_inf_off_the_mask():
  log_ratio = _wide_inputs()["logprobs"] + 1.0
  clean = losses.ratio_statistics(log_ratio, WIDE_MASK)
  bad = losses.ratio_statistics(_poisoned(log_ratio), WIDE_MASK)
  for key in clean:
    assert np.isfinite(clean[key])
    np.testing.assert_array_equal(bad[key], clean[key], err_msg=key)
  np.testing.assert_array_equal(losses.masked_mean(_poisoned(log_ratio), WIDE_MASK),
                                losses.masked_mean(log_ratio, WIDE_MASK))


def test_truncation_level_shrinks_levels_above_one_with_lag():
  lag = np.array([[0, 1, 3]], np.int32)
  # 1 + 0.5 / (1 + lag): 1.5, 1.25, 1.125.
  np.testing.assert_allclose(losses.truncation_level(1.5, lag, 1.0), [[1.5, 1.25, 1.125]],
                             rtol=1e-6)
  # A level at or below 1 never loosens toward 1.
  np.testing.assert_array_equal(losses.truncation_level(0.8, lag, 1.0),
                                np.full((1, 3), 0.8, np.float32))
  np.testing.assert_array_equal(losses.truncation_level(1.0, lag, 1.0), [[1.0, 1.0, 1.0]])
  assert losses.truncation_level(1.5, lag, 0.0) == 1.5
  assert losses.truncation_level(1.5, None, 1.0) == 1.5


@pytest.mark.parametrize("jit", [False, True])
def test_vtrace_targets_carry_rewards_on_skipped_columns_to_the_action_before(jit):
  """Sampled columns 1, 2, 4; rewards 0.3 on the prompt column 0 (before any
  action: dropped), 0.5 on the environment column 3 (r_2) and 1.0 on the
  padding column 5 (r_3). V = 0.5, 0.2, 0.9; rho = 2, 0.5, 1; lambda 0.9:

    i=3: r3 = 1;   delta = 1 * (1 + 0 - 0.9) = 0.1;  v3 = 1.0;  A3 = 0.1
    i=2: r2 = 0.5; delta = 0.5 * (0.5 + 0.9 - 0.2) = 0.6
         v2 = 0.2 + 0.6 + 0.9 * 0.5 * (1.0 - 0.9) = 0.845;  A2 = 0.5 + 1.0 - 0.2 = 1.3
    i=1: r1 = 0;   delta = 1 * (0 + 0.2 - 0.5) = -0.3
         v1 = 0.5 - 0.3 + 0.9 * 1 * (0.845 - 0.2) = 0.7805;  A1 = 0.845 - 0.5 = 0.345
  """
  mask = np.array([[0, 1, 1, 0, 1, 0]], np.float32)
  values = np.array([[9.0, 0.5, 0.2, 7.0, 0.9, 3.0]], np.float32)
  log_rhos = np.log(np.array([[5.0, 2.0, 0.5, 5.0, 1.0, 5.0]], np.float32))
  rewards = np.array([[0.3, 0.0, 0.0, 0.5, 0.0, 1.0]], np.float32)
  fn = maybe_jit(vtrace_lib.vtrace_targets, jit, lam=0.9)
  vs, adv = fn(values, rewards, log_rhos, mask)
  np.testing.assert_allclose(vs, [[0, 0.7805, 0.845, 0, 1.0, 0]], rtol=1e-5)
  np.testing.assert_allclose(adv, [[0, 0.345, 1.3, 0, 0.1, 0]], rtol=1e-5, atol=1e-7)
  # The same as the rewards placed on the sampled tokens they are carried to,
  # whatever the values and ratios off the mask hold.
  moved = np.array([[0.0, 0.0, 0.5, 0.0, 1.0, 0.0]], np.float32)
  poison = np.array([[np.nan, 0, 0, np.inf, 0, -np.inf]], np.float32)
  vs2, adv2 = fn(np.where(mask > 0, values, poison), moved,
                 np.where(mask > 0, log_rhos, poison), mask)
  np.testing.assert_allclose(vs2, vs, rtol=1e-6)
  np.testing.assert_allclose(adv2, adv, rtol=1e-6)


def test_vtrace_targets_with_rewards_on_skipped_columns_on_policy_are_the_returns():
  # lambda = 1, ratios 1: v_i is the sum of every reward from t_i to the row's end.
  mask = np.array([[1, 0, 1, 0, 0], [0, 1, 1, 0, 1]], np.float32)
  rewards = np.array([[0.1, 0.2, 0.4, 0.8, 1.6], [5.0, 0.1, 0.2, 0.4, 0.8]], np.float32)
  values = np.random.default_rng(0).normal(size=(2, 5)).astype(np.float32)
  vs, _ = vtrace_lib.vtrace_targets(values, rewards, np.zeros_like(values), mask)
  np.testing.assert_allclose(vs, [[3.1, 0, 2.8, 0, 0], [0, 1.5, 1.4, 0, 0.8]], rtol=1e-6)


def test_vtrace_targets_with_per_token_truncation_levels():
  """rho = 1.4 at both tokens, levels rho_bar = 1.5, 1.2 and c_bar = 1.3, 1.1;
  V = 0.5, 0.2; R = 1; lambda 1:

    i=2: delta = min(1.2, 1.4) * (1 - 0.2) = 0.96;  v2 = 1.16;  A2 = 0.8
    i=1: delta = min(1.5, 1.4) * (0.2 - 0.5) = -0.42
         v1 = 0.5 - 0.42 + min(1.3, 1.4) * (1.16 - 0.2) = 1.328;  A1 = 1.16 - 0.5 = 0.66
  """
  mask = np.ones((1, 2), np.float32)
  values = np.array([[0.5, 0.2]], np.float32)
  log_rhos = np.log(np.full((1, 2), 1.4, np.float32))
  rewards = np.array([[0.0, 1.0]], np.float32)
  vs, adv = vtrace_lib.vtrace_targets(values, rewards, log_rhos, mask,
                                      rho_bar=np.array([[1.5, 1.2]], np.float32),
                                      c_bar=np.array([[1.3, 1.1]], np.float32))
  np.testing.assert_allclose(vs, [[1.328, 1.16]], rtol=1e-5)
  np.testing.assert_allclose(adv, [[0.66, 0.8]], rtol=1e-5)
  with pytest.raises(AssertionError):
    vtrace_lib.vtrace_targets(values, rewards, log_rhos, mask, rho_bar=np.ones((1, 3)))
