"""The learner's update step: a module-level pure function, jitted where wired.

`make_update_fn` applies `jax.jit` with explicit in/out shardings (outputs
pinned to the inputs' layout, so a donated state never changes shape or
placement between steps) and donates the old state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arl_jax import train_batch as train_batch_lib
from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import train_state as train_state_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSettings:
  """Static loss settings: the loss name (a key of `losses.LOSSES`) and its knobs."""

  name: str = "clipped_ratio"
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float | None = None
  temperature: float = 1.0

  def loss_fn(self) -> Callable:
    if self.name not in losses_lib.LOSSES:
      raise ValueError(f"loss {self.name!r} unknown; known: {sorted(losses_lib.LOSSES)}")
    return functools.partial(losses_lib.LOSSES[self.name], eps_low=self.eps_low,
                             eps_high=self.eps_high, dual_clip=self.dual_clip)


def train_step(state: train_state_lib.TrainState, batch: train_batch_lib.TrainBatch, *,
               graphdef, optimizer: optax.GradientTransformation, settings: LossSettings):
  """One policy-gradient update on a batch of (possibly version-mixed) rollouts.

  Returns:
    `(new_state, metrics)`; metrics are float32 scalars.
  """
  loss_fn = settings.loss_fn()
  advantages = jnp.broadcast_to(batch.advantages[:, None], batch.loss_mask.shape)

  def objective(params):
    logp, entropy = logprobs_lib.token_logprobs_and_entropy(
        graphdef, params, batch.tokens, batch.token_mask, settings.temperature)
    loss, metrics = loss_fn(logp, batch.behaviour_logprobs, advantages, batch.loss_mask)
    metrics["entropy"] = losses_lib.masked_mean(entropy, batch.loss_mask)
    # The same statistics on lag-0 rows isolate trainer/inference mismatch.
    log_ratio = (logp - batch.behaviour_logprobs) * batch.loss_mask
    lag0 = batch.loss_mask * (batch.lag[:, None] == 0)
    metrics["abs_log_ratio_lag0"] = losses_lib.masked_mean(jnp.abs(log_ratio), lag0)
    # k3 estimator of KL(mu || pi_theta) from tokens drawn from mu (Schulman,
    # 2020): with r = pi/mu, E_mu[r - 1 - log r] = KL(mu || pi), each term >= 0.
    metrics["kl_behaviour"] = losses_lib.masked_mean(jnp.exp(log_ratio) - 1 - log_ratio,
                                                     batch.loss_mask)
    return loss, metrics

  (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics.update(loss=loss, grad_norm=optax.global_norm(grads),
                 trained_tokens=jnp.sum(batch.loss_mask))
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, jax.tree.map(lambda x: x.astype(jnp.float32), metrics)


def batch_shardings(mesh: Mesh) -> train_batch_lib.TrainBatch:
  """Rows sharded over the learner's `fsdp` axis (data parallel), columns whole."""
  rows = NamedSharding(mesh, P("fsdp" if "fsdp" in mesh.axis_names else None))
  fields = {f.name: rows for f in dataclasses.fields(train_batch_lib.TrainBatch)}
  return train_batch_lib.TrainBatch(**fields)


def make_update_fn(*, graphdef, optimizer, settings: LossSettings, state_shardings, mesh: Mesh,
                   step_fn=train_step):
  """Jits `step_fn` with explicit shardings and a donated state."""
  step = functools.partial(step_fn, graphdef=graphdef, optimizer=optimizer, settings=settings)
  return jax.jit(step, in_shardings=(state_shardings, batch_shardings(mesh)),
                 out_shardings=(state_shardings, NamedSharding(mesh, P())),
                 donate_argnums=0)
