"""The learner's optimizer: AdamW behind global-norm clipping, at a rate that
may follow a schedule (linear warm-up, then constant, linear or cosine decay)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import optax

from arl_jax.core import settings

SCHEDULES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  """The optimizer's settings (keys of the config's `learner` section).

  Attributes:
    lr: AdamW's learning rate (the peak of a schedule).
    lr_schedule: after the warm-up: constant | linear (to lr_min) | cosine
      (to lr_min).
    lr_warmup_steps: updates whose rate rises linearly to lr, update u at
      lr * (u + 1) / lr_warmup_steps (0: none).
    lr_decay_steps: updates the decay lasts after the warm-up (0: to the
      run's last update); the rate then stays at lr_min.
    lr_min: the rate a decay ends at.
    b1: AdamW's first-moment decay.
    b2: AdamW's second-moment decay.
    adam_eps: AdamW's denominator epsilon.
    weight_decay: AdamW's decoupled weight decay.
    max_grad_norm: gradients are clipped to this global norm first.
  """

  lr: float = 3e-4
  lr_schedule: str = "constant"
  lr_warmup_steps: int = 0
  lr_decay_steps: int = 0
  lr_min: float = 0.0
  b1: float = 0.9
  b2: float = 0.99
  adam_eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0

  def __post_init__(self):
    settings.check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
    settings.check(self.lr_schedule in SCHEDULES, "lr_schedule",
                   f"must be one of {SCHEDULES}, got {self.lr_schedule!r}")
    for key in ("lr_warmup_steps", "lr_decay_steps"):
      value = getattr(self, key)
      settings.check(settings.is_int(value) and value >= 0, key,
                     f"must be an int >= 0, got {value!r}")
    settings.check(0 <= self.lr_min <= self.lr, "lr_min",
                   f"must be in [0, lr={self.lr}], got {self.lr_min}")
    for key in ("b1", "b2"):
      value = getattr(self, key)
      settings.check(0 <= value < 1, key, f"must be in [0, 1), got {value}")
    settings.check(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
    settings.check(self.weight_decay >= 0, "weight_decay",
                   f"must be >= 0, got {self.weight_decay}")
    settings.check(self.max_grad_norm > 0, "max_grad_norm",
                   f"must be > 0, got {self.max_grad_norm}")

  @property
  def is_constant(self) -> bool:
    """Whether every update trains at `lr` (one warm-up update is at `lr` too)."""
    return self.lr_schedule == "constant" and self.lr_warmup_steps <= 1


def learning_rate(cfg: OptimConfig, num_updates: int) -> Callable:
  """The rate of update `u` (0-based) in a run of `num_updates` updates:
  `rate(u)` for an int or a traced count, as float32.

  Warm-up `W` updates at `lr * (u + 1) / W` (the first update trains, unlike
  a ramp from 0), then over `D` updates (`lr_decay_steps`, or the rest of the
  run) the decay from lr to lr_min: `linear` 1 - p, `cosine` (1 + cos(pi p)) / 2
  of the way, with p = (u - W) / D clipped to [0, 1].
  """
  warmup = cfg.lr_warmup_steps
  decay = cfg.lr_decay_steps or max(num_updates - warmup, 1)
  alpha = cfg.lr_min / cfg.lr
  if cfg.lr_schedule == "linear":
    after = optax.linear_schedule(cfg.lr, cfg.lr_min, decay)
  elif cfg.lr_schedule == "cosine":
    after = optax.cosine_decay_schedule(cfg.lr, decay, alpha=alpha)
  else:
    after = optax.constant_schedule(cfg.lr)
  if warmup == 0:
    return lambda u: jnp.asarray(after(u), jnp.float32)
  # Updates 0..W-1 ramp to lr; the decay's p = 0 falls on update W. One
  # warm-up update is a real one (update 0 at lr, the decay from update 1):
  # taking it as "no warm-up" would start the decay an update early.
  ramp = optax.linear_schedule(cfg.lr / warmup, cfg.lr, max(warmup - 1, 1))
  schedule = optax.join_schedules([ramp, after], [warmup])
  return lambda u: jnp.asarray(schedule(u), jnp.float32)


def make_optimizer(cfg: OptimConfig, num_updates: int = 0,
                   optimizer_steps: int = 1) -> optax.GradientTransformation:
  """AdamW behind clipping; a schedule counts updates (`optimizer_steps`
  optimizer steps each: the rate is constant within an update). A constant
  rate keeps the optimizer state of a plain float rate (and so a checkpoint's
  layout)."""
  if cfg.is_constant:
    rate = cfg.lr
  else:
    per_update = learning_rate(cfg, num_updates)
    rate = lambda count: per_update(count // optimizer_steps)
  return optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.adamw(rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay),
  )
