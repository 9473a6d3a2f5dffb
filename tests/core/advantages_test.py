"""Advantages as properties over every group size 1-64 and random valid masks
(not only hand-sized examples): a group of equal rewards carries no signal
under every estimator with a group baseline, invalid rollouts never count,
and each estimator matches its formula written here in float64."""

import numpy as np
import pytest

from arl_jax.core import advantages as advantages_lib

GROUP_BASELINED = ("grpo", "grpo_no_std", "rloo", "reinforce_pp_baseline")
EPS = 1e-6


def test_the_reported_reproductions_give_zero():
  """A group mean summed in float32 was an ulp off the common reward, and
  `/ (std + eps)` made that a same-signed advantage for the whole group."""
  np.testing.assert_array_equal(
      advantages_lib.group_advantages(np.full((1, 3), 0.9, np.float32), "grpo"), 0.0)
  np.testing.assert_array_equal(advantages_lib.group_advantages(
      np.full((1, 8), 0.7, np.float32), "grpo",
      valid=np.array([[False] * 3 + [True] * 5])), 0.0)
  np.testing.assert_array_equal(advantages_lib.group_advantages(
      np.array([[0.9, 0.9, 0.9], [1.0, 0.0, 0.3]], np.float32), "reinforce_pp_baseline")[0], 0.0)


def _reference(rewards, valid, estimator):
  """Each estimator's formula, row by row, in float64 (`advantages.py`'s docstring)."""
  r = rewards.astype(np.float64)
  out = np.zeros_like(r)
  if estimator == "reinforce_pp":
    kept = r[valid]
    if kept.size:
      out[valid] = (kept - kept.mean()) / (kept.std() + EPS)
    return out
  for row in range(r.shape[0]):
    v = valid[row]
    x = r[row, v]
    if x.size == 0:
      continue
    if estimator == "rloo":
      n = x.size
      out[row, v] = [xi - (x.sum() - xi) / (n - 1) for xi in x] if n > 1 else 0.0
    elif estimator == "grpo":
      out[row, v] = (x - x.mean()) / (x.std() + EPS)
    else:  # grpo_no_std, and reinforce_pp_baseline's first step
      out[row, v] = x - x.mean()
  if estimator == "reinforce_pp_baseline" and valid.any():
    centred = out[valid]
    out[valid] = (centred - centred.mean()) / (centred.std() + EPS)
  return out


def _batch(rng, group_size, num_groups=4):
  """Rewards of a few kinds (binary, float32 values that are no binary
  fractions, equal within a group) and a random valid mask."""
  kind = rng.integers(3)
  if kind == 0:
    rewards = rng.integers(0, 2, (num_groups, group_size)).astype(np.float32)
  elif kind == 1:
    rewards = rng.choice(np.float32([0.1, 0.3, 0.7, 0.9, 1 / 3, -0.25]),
                         (num_groups, group_size))
  else:
    rewards = rng.normal(size=(num_groups, group_size)).astype(np.float32)
  # Half the groups get one reward for every rollout.
  equal = rng.random(num_groups) < 0.5
  rewards[equal] = rng.choice(np.float32([0.9, 0.7, 0.1, 1 / 3, 1.0, 0.0, 2.5]),
                              (int(equal.sum()), 1))
  valid = rng.random((num_groups, group_size)) < rng.uniform(0.3, 1.0)
  return rewards, valid, equal


@pytest.mark.parametrize("estimator", advantages_lib.ADVANTAGE_ESTIMATORS)
def test_every_group_size_and_mask_matches_the_formula_and_equal_groups_get_zero(estimator):
  rng = np.random.default_rng(advantages_lib.ADVANTAGE_ESTIMATORS.index(estimator))
  for group_size in range(1, 65):
    for _ in range(3):
      rewards, valid, equal = _batch(rng, group_size)
      adv = advantages_lib.group_advantages(rewards, estimator, EPS, valid=valid)
      assert adv.dtype == np.float32 and adv.shape == rewards.shape
      assert np.all(adv[~valid] == 0.0)  # invalid rollouts get nothing
      np.testing.assert_allclose(adv, _reference(rewards, valid, estimator), rtol=2e-5,
                                 atol=2e-5, err_msg=f"{estimator}, G={group_size}")
      if estimator in GROUP_BASELINED:
        # Exactly 0, not an ulp's worth of bias blown up by the std.
        assert np.all(adv[equal] == 0.0), (estimator, group_size, rewards[equal], adv[equal])
      # What invalid rollouts hold never changes anything.
      noise = np.where(valid, rewards, rng.normal(size=rewards.shape).astype(np.float32) * 9)
      np.testing.assert_array_equal(
          advantages_lib.group_advantages(noise, estimator, EPS, valid=valid), adv)


@pytest.mark.parametrize("value", [0.9, 0.7, 0.1, 1 / 3, 2.5, -1.3, 0.0])
def test_a_batch_of_equal_rewards_trains_nothing_under_any_estimator(value):
  rng = np.random.default_rng(0)
  for group_size in range(1, 65):
    rewards = np.full((3, group_size), value, np.float32)
    valid = rng.random(rewards.shape) < 0.7
    for estimator in advantages_lib.ADVANTAGE_ESTIMATORS:
      adv = advantages_lib.group_advantages(rewards, estimator, valid=valid)
      assert np.all(adv == 0.0), (estimator, group_size, value)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "rloo"])
def test_a_group_s_advantages_do_not_move_with_a_shift_of_its_rewards(estimator):
  """A group baseline: adding a constant to a group's rewards changes nothing
  (grpo is also scale-free)."""
  rng = np.random.default_rng(1)
  for group_size in range(2, 65, 7):
    rewards = rng.integers(0, 2, (2, group_size)).astype(np.float32)
    adv = advantages_lib.group_advantages(rewards, estimator)
    np.testing.assert_allclose(advantages_lib.group_advantages(rewards + 0.3, estimator), adv,
                               atol=1e-5)
    if estimator == "grpo":
      np.testing.assert_allclose(advantages_lib.group_advantages(rewards * 4.0, estimator),
                                 adv, atol=1e-5)
