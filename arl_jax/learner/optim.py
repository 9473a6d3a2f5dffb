"""The learner's optimizer: AdamW behind global-norm clipping."""

from __future__ import annotations

import dataclasses

import optax

from arl_jax import settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  """The optimizer's settings (keys of the config's `learner` section).

  Attributes:
    lr: AdamW's learning rate.
    b1: AdamW's first-moment decay.
    b2: AdamW's second-moment decay.
    adam_eps: AdamW's denominator epsilon.
    weight_decay: AdamW's decoupled weight decay.
    max_grad_norm: gradients are clipped to this global norm first.
  """

  lr: float = 3e-4
  b1: float = 0.9
  b2: float = 0.99
  adam_eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0

  def __post_init__(self):
    settings.check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
    for key in ("b1", "b2"):
      value = getattr(self, key)
      settings.check(0 <= value < 1, key, f"must be in [0, 1), got {value}")
    settings.check(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
    settings.check(self.weight_decay >= 0, "weight_decay",
                   f"must be >= 0, got {self.weight_decay}")
    settings.check(self.max_grad_norm > 0, "max_grad_norm",
                   f"must be > 0, got {self.max_grad_norm}")


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.adamw(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.adam_eps,
                  weight_decay=cfg.weight_decay),
  )
