"""The learner's optimizer: AdamW behind global-norm clipping."""

from __future__ import annotations

import dataclasses

import optax


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  lr: float = 3e-4
  b1: float = 0.9
  b2: float = 0.99
  eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0

  def __post_init__(self):
    if self.lr <= 0:
      raise ValueError(f"learning rate must be positive, got {self.lr}")
    if self.max_grad_norm <= 0:
      raise ValueError(f"max_grad_norm must be positive, got {self.max_grad_norm}")


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.adamw(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
  )
