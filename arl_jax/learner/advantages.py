"""Group-relative advantages (GRPO; Shao et al., 2024, DeepSeekMath)."""

from __future__ import annotations

import numpy as np

ADVANTAGE_ESTIMATORS = ("grpo", "grpo_no_std")


def group_advantages(rewards: np.ndarray, estimator: str = "grpo", eps: float = 1e-6) -> np.ndarray:
  """Advantages of the rollouts of groups.

  `grpo`: `(r - mean(r_group)) / (std(r_group) + eps)`; `grpo_no_std` drops the
  std scaling (Dr. GRPO, Liu et al., 2025), which avoids up-weighting groups
  that are almost all right or all wrong.

  Args:
    rewards: `[num_groups, G]` float.
    estimator: one of ADVANTAGE_ESTIMATORS.
    eps: added to the std so a constant-reward group gets advantage 0, not NaN.

  Returns:
    `[num_groups, G]` float32 advantages.
  """
  rewards = np.asarray(rewards, np.float32)
  if rewards.ndim != 2:
    raise ValueError(f"rewards must be [num_groups, G], got shape {rewards.shape}")
  centred = rewards - rewards.mean(axis=1, keepdims=True)
  if estimator == "grpo":
    return (centred / (rewards.std(axis=1, keepdims=True) + eps)).astype(np.float32)
  if estimator == "grpo_no_std":
    return centred.astype(np.float32)
  raise ValueError(f"advantage estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
