"""Learning-rate schedules: the rates by hand, the optimizer following them
update by update, and a constant rate keeping a plain AdamW's state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arl_jax import settings
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
