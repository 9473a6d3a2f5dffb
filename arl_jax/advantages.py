"""Group-relative advantages: GRPO (Shao et al., 2024, DeepSeekMath) and RLOO."""

from __future__ import annotations

import numpy as np

ADVANTAGE_ESTIMATORS = ("grpo", "grpo_no_std", "rloo")


def group_advantages(rewards: np.ndarray, estimator: str = "grpo", eps: float = 1e-6,
                     valid: np.ndarray | None = None) -> np.ndarray:
  """Advantages of the rollouts of groups.

  `grpo`: `(r - mean(r_group)) / (std(r_group) + eps)`; `grpo_no_std` drops the
  std scaling (Dr. GRPO, Liu et al., 2025), which avoids up-weighting groups
  that are almost all right or all wrong. `rloo`: leave-one-out baseline
  `r_i - mean_{j != i} r_j` (Kool et al., 2019; Ahmadian et al., 2024), unbiased
  because a rollout's baseline does not depend on its own reward.

  Args:
    rewards: `[num_groups, G]` float.
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
  return centred.astype(np.float32)
