"""Learning-rate schedules: the rates by hand, the optimizer following them
update by update, and a constant rate keeping a plain AdamW's state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arl_jax.core import settings
from arl_jax.learner import optim


def _rates(num_updates=14, **fields):
  rate = optim.learning_rate(optim.OptimConfig(**fields), num_updates)
  return np.array([float(rate(u)) for u in range(num_updates + 2)])


def test_schedules_by_hand():
  # Warm-up 4: 1/4, 2/4, 3/4, 1; then 10 updates of decay from 1 to 0.1.
  warm = [0.25, 0.5, 0.75, 1.0]
  np.testing.assert_allclose(_rates(lr=1.0, lr_warmup_steps=4), warm + [1.0] * 12)
  p = np.arange(12) / 10  # (u - 4) / 10, updates 4..15
  np.testing.assert_allclose(_rates(lr=1.0, lr_schedule="linear", lr_warmup_steps=4, lr_min=0.1),
                             warm + list(np.maximum(1 - 0.9 * p, 0.1)), rtol=1e-6)
  cosine = 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * np.minimum(p, 1)))
  np.testing.assert_allclose(_rates(lr=1.0, lr_schedule="cosine", lr_warmup_steps=4, lr_min=0.1),
                             warm + list(cosine), rtol=1e-5)
  # lr_decay_steps: the decay lasts 5 updates, then stays at lr_min.
  np.testing.assert_allclose(_rates(lr=2.0, lr_schedule="linear", lr_decay_steps=5)[:8],
                             [2.0, 1.6, 1.2, 0.8, 0.4, 0.0, 0.0, 0.0], atol=1e-6)


def test_the_optimizer_follows_the_schedule_one_rate_per_update():
  # SGD-like probe: AdamW's first step moves each parameter by lr * sign(grad)
  # (b1 = b2 = 0: m / sqrt(v) = sign), so the step size reads the rate.
  cfg = optim.OptimConfig(lr=1.0, lr_schedule="linear", lr_warmup_steps=2, b1=0.0, b2=0.0,
                          max_grad_norm=1e9)
  opt = optim.make_optimizer(cfg, num_updates=6, optimizer_steps=3)
  params = jnp.zeros(())
  state = opt.init(params)
  moves = []
  for _ in range(18):
    updates, state = opt.update(jnp.ones(()), state, params)
    moves.append(-float(updates))
  expected = np.repeat([float(optim.learning_rate(cfg, 6)(u)) for u in range(6)], 3)
  np.testing.assert_allclose(moves, expected, rtol=1e-5)
  np.testing.assert_allclose(expected[::3], [0.5, 1.0, 1.0, 0.75, 0.5, 0.25], rtol=1e-6)


def test_a_constant_rate_keeps_plain_adamws_state():
  plain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, b2=0.99))
  mine = optim.make_optimizer(optim.OptimConfig(lr=1e-3))
  params = {"w": jnp.ones((2,))}
  assert (jax.tree.structure(mine.init(params)) == jax.tree.structure(plain.init(params)))


@pytest.mark.parametrize("fields,message", [
    (dict(lr_schedule="step"), "lr_schedule: must be one of"),
    (dict(lr_warmup_steps=-1), "lr_warmup_steps: must be an int >= 0"),
    (dict(lr_decay_steps=2.5), "lr_decay_steps: must be an int >= 0"),
    (dict(lr=1e-3, lr_min=1e-2), "lr_min: must be in \\[0, lr=0.001\\]"),
])
def test_bad_schedules_are_named(fields, message):
  with pytest.raises(settings.SettingError, match=message):
    optim.OptimConfig(**fields)


def _formula(u, *, lr, lr_schedule, lr_warmup_steps, lr_decay_steps, lr_min, num_updates):
  """docs/algorithms.md's schedule, written out in float64."""
  w = lr_warmup_steps
  if u < w:
    return lr * (u + 1) / w
  decay = lr_decay_steps or max(num_updates - w, 1)
  p = min(max((u - w) / decay, 0.0), 1.0)
  if lr_schedule == "linear":
    return lr + (lr_min - lr) * p
  if lr_schedule == "cosine":
    return lr_min + (lr - lr_min) * 0.5 * (1 + np.cos(np.pi * p))
  return lr


def test_the_reported_one_update_warm_up_starts_the_decay_at_update_one():
  rate = optim.learning_rate(optim.OptimConfig(lr=1.0, lr_schedule="cosine",
                                               lr_warmup_steps=1), 5)
  np.testing.assert_allclose([float(rate(u)) for u in range(5)],
                             [1.0, 1.0, 0.8535534, 0.5, 0.1464466], rtol=1e-6)
  # With lr_decay_steps=D the decay's last step below lr_min is update W + D - 1.
  rate = optim.learning_rate(optim.OptimConfig(lr=1.0, lr_schedule="linear", lr_warmup_steps=1,
                                               lr_decay_steps=4), 10)
  np.testing.assert_allclose([float(rate(u)) for u in range(7)],
                             [1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0], atol=1e-7)


@pytest.mark.parametrize("schedule", optim.SCHEDULES)
def test_every_schedule_edge_matches_its_formula_at_every_update(schedule):
  """Warm-up 0, 1, 2 and 5 updates; decay lengths 0 (the rest of the run), 1,
  2 and 7; runs of 1 to 12 updates; lr_min 0 and above: every update's rate
  is the formula's, the warm-up rises and the decay falls to lr_min."""
  for num_updates in (1, 2, 3, 12):
    for warmup in (0, 1, 2, 5):
      for decay in (0, 1, 2, 7):
        for lr_min in (0.0, 0.25):
          fields = dict(lr=1.0, lr_schedule=schedule, lr_warmup_steps=warmup,
                        lr_decay_steps=decay, lr_min=lr_min)
          rate = optim.learning_rate(optim.OptimConfig(**fields), num_updates)
          got = np.array([float(rate(u)) for u in range(num_updates + 3)])
          want = np.array([_formula(u, num_updates=num_updates, **fields)
                           for u in range(num_updates + 3)])
          np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=str(fields))
          # The first update trains; the warm-up rises to lr and the decay
          # never rises, nor goes below lr_min.
          assert got[0] > 0 and np.all(got <= 1.0 + 1e-7)
          assert np.all(np.diff(got[:warmup]) > 0) and np.all(np.diff(got[warmup:]) <= 1e-7)
          assert np.all(got[warmup:] >= lr_min - 1e-7)
