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
  argues over-weights nearly-solved prompts). The batch is the rows given
  (one TrainBatch); REINFORCE++'s KL-in-reward is not applied (arl_jax's KL
  is a loss term: `learner.kl_coef`).

  Args:
    rewards: `[num_groups, G]` float (a whole batch's groups).
    estimator: one of ADVANTAGE_ESTIMATORS.
    eps: added to the std so a constant-reward group gets advantage 0, not NaN.
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
  count = np.maximum(valid.sum(axis=1, keepdims=True), 1)
  mean = np.where(valid, rewards, 0.0).sum(axis=1, keepdims=True) / count
  centred = np.where(valid, rewards - mean, 0.0)
  if estimator == "rloo":
    # r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean); 0 when n < 2.
    n = valid.sum(axis=1, keepdims=True)
    return np.where(n > 1, centred * n / np.maximum(n - 1, 1), 0.0).astype(np.float32)
  if estimator == "grpo":
    std = np.sqrt((centred ** 2).sum(axis=1, keepdims=True) / count)
    centred = centred / (std + eps)
  if estimator.startswith("reinforce_pp"):
    values = rewards if estimator == "reinforce_pp" else centred
    n = max(int(valid.sum()), 1)
    mean = np.where(valid, values, 0.0).sum() / n
    std = np.sqrt((np.where(valid, values - mean, 0.0) ** 2).sum() / n)
    centred = np.where(valid, (values - mean) / (std + eps), 0.0)
  return centred.astype(np.float32)
