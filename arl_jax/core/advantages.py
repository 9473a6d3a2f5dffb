"""Advantages from a batch's rewards: group-relative (GRPO, Shao et al., 2024,
DeepSeekMath; RLOO) and batch-normalised (REINFORCE++)."""

from __future__ import annotations

import numpy as np

ADVANTAGE_ESTIMATORS = ("grpo", "grpo_no_std", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def group_advantages(rewards: np.ndarray, estimator: str = "grpo", eps: float = 1e-6,
                     valid: np.ndarray | None = None) -> np.ndarray:
  """Advantages of the rollouts of groups.

  `grpo`: `(r - mean(r_group)) / (std(r_group) + eps)`; `grpo_no_std` drops the
  std scaling (Dr. GRPO, Liu et al., 2025), which avoids up-weighting groups
  that are almost all right or all wrong. `rloo`: leave-one-out baseline
  `r_i - mean_{j != i} r_j` (Kool et al., 2019; Ahmadian et al., 2024), unbiased
  because a rollout's baseline does not depend on its own reward.

  `reinforce_pp` (REINFORCE++, Hu et al., 2025, arXiv:2501.03262): no group
  baseline, the rewards normalised over the whole batch, `(r - mean_batch) /
  (std_batch + eps)`; a group whose rewards are equal still gets a non-zero
  advantage. `reinforce_pp_baseline` (REINFORCE++-baseline): the group mean
  subtracted first, then the batch's normalisation of the result, so the
  scale is the batch's, not each group's (GRPO's std, which REINFORCE++
  argues over-weights nearly-solved prompts); the centred values' batch mean
  is 0 by construction, so it is not subtracted again. The batch is the rows given
  (one TrainBatch); REINFORCE++'s KL-in-reward is not applied (arl_jax's KL
  is a loss term: `learner.kl_coef`).

  Args:
    rewards: `[num_groups, G]` float (a whole batch's groups).
    estimator: one of ADVANTAGE_ESTIMATORS.
    eps: added to the std so a constant-reward group gets advantage 0, not NaN.
      A group whose valid rewards are equal gets exactly 0 from every
      estimator but `reinforce_pp` (which has no group baseline).
    valid: optional `[num_groups, G]` bool; invalid rollouts (environment
      errors; truncated completions when masked) neither enter their group's
      statistics nor get an advantage.

  Returns:
    `[num_groups, G]` float32 advantages (0 where invalid).
  """
  if estimator not in ADVANTAGE_ESTIMATORS:
    raise ValueError(
        f"advantage estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
  rewards = np.asarray(rewards, np.float32)
  if rewards.ndim != 2:
    raise ValueError(f"rewards must be [num_groups, G], got shape {rewards.shape}")
  valid = np.ones(rewards.shape, bool) if valid is None else np.asarray(valid, bool)
  if valid.shape != rewards.shape:
    raise ValueError(f"valid has shape {valid.shape}, rewards {rewards.shape}")
  # Statistics in float64 over rewards already rounded to float32: a sum of
  # n float32 values is then exact (n < 2^29), so a group whose rewards are
  # equal has a mean equal to its reward and centres to exactly 0. In float32
  # the mean of, say, three 0.9s is an ulp off, and dividing by `std + eps`
  # blows that ulp up to an advantage of ~0.04, the same sign for the whole
  # group: a bias on exactly the groups that carry no signal.
  rewards64 = rewards.astype(np.float64)
  n = valid.sum(axis=1, keepdims=True)
  count = np.maximum(n, 1)
  mean = np.where(valid, rewards64, 0.0).sum(axis=1, keepdims=True) / count
  centred = np.where(valid, rewards64 - mean, 0.0)
  if estimator == "rloo":
    # r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean); 0 when n < 2.
    return np.where(n > 1, centred * n / np.maximum(n - 1, 1), 0.0).astype(np.float32)
  if estimator == "grpo":
    std = np.sqrt((centred ** 2).sum(axis=1, keepdims=True) / count)
    centred = centred / (std + eps)
  if estimator == "reinforce_pp":
    total = max(int(valid.sum()), 1)
    batch_mean = np.where(valid, rewards64, 0.0).sum() / total
    values = np.where(valid, rewards64 - batch_mean, 0.0)
    std = np.sqrt((values ** 2).sum() / total)
    centred = values / (std + eps)
  elif estimator == "reinforce_pp_baseline":
    # The group-centred values have batch mean 0 (every group's sum to 0), so
    # only their spread is taken: subtracting a computed mean of ~1e-17 would
    # hand equal-reward groups (centred to exactly 0) a rounding residue.
    total = max(int(valid.sum()), 1)
    std = np.sqrt((centred ** 2).sum() / total)
    centred = centred / (std + eps)
  return centred.astype(np.float32)
