"""The learner's update step: a module-level pure function, jitted where wired.

One call consumes one TrainBatch `B_u` and may take several optimizer steps:
`num_epochs` passes over `num_minibatches` minibatches, each the gradient
accumulated over `num_microbatches` microbatches (so a big batch fits in
memory). With more than one optimizer step per batch the policy at the start
of the batch is recomputed as the proximal policy and the objective is
decoupled (see `losses`); a single step may opt in with `decoupled=True` or a
mismatch correction (`mismatch.Correction`), and then its proximal policy is
its own log-probs, stop-gradient: the params at the start of the batch are
the ones being differentiated, so no extra forward pass is needed.

Minibatch `i` of `n` takes rows `i, i + n, i + 2n, ...` (and microbatches
split a minibatch the same way), so every slice stays spread over the `fsdp`
axis the rows are sharded on. Every slice is aggregated with the token
weights of its minibatch (`losses.token_weights`), so accumulation gives the
same gradient as one pass over the minibatch.

A non-finite loss or gradient skips that optimizer step: params and optimizer
state stay as they were and `skipped_steps` counts it. Only the trained tokens
can cause that: whatever masked columns hold (a NaN behaviour log-prob of an
errored rollout) is selected away with `jnp.where` before any arithmetic, here
and in `losses`, so it reaches neither the loss, its gradient nor the metrics.

With a critic, its V-trace targets use the same per-token truncation levels as
the policy loss: under the age-aware trust region both `rho_bar` and `c_bar`
shrink with each token's lag (`losses.truncation_level`).

`make_update_fn` applies `jax.jit` with explicit in/out shardings (outputs
pinned to the inputs' layout, so a donated state never changes shape or
placement between steps) and donates the old state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arl_jax.core import train_batch as train_batch_lib
from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.learner import loss_settings as loss_settings_lib
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import segments as segments_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.learner import vtrace as vtrace_lib
from arl_jax.models import fingerprint
from arl_jax.models import lora as lora_lib

# Token-lag buckets of the |log-ratio| metrics: (name, lowest lag, highest lag).
# One a lag up to the default bound (8), so that the adaptive bound can give
# up exactly the lag that fails: with a 5-8 bucket, a failure at lag 7
# supported only K = 4 (benchmarks/README.md, `staleness.py`).
LAG_BUCKETS = (*((str(lag), lag, lag) for lag in range(9)), ("9+", 9, 1 << 30))
# The metrics key of the new params' fingerprint sums (`make_update_fn`).
PARAMS_SUMS = "params_sums"


def _split(tree, n: int):
  """`[B, ...] -> [n, B / n, ...]`; slice `i` holds rows `i, i + n, ...`."""
  def split(x):
    if x.shape[0] % n:
      raise ValueError(f"{x.shape[0]} rows do not split into {n} equal slices")
    x = x.reshape(x.shape[0] // n, n, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, tree)


def _combine(stacked, tokens=None):
  """Reduces stacked per-slice metrics: `*_max` by max, `*_min` by min, others
  by the mean weighted by each slice's trained tokens (`tokens`, `[n]`), so
  that slices with few tokens (or none) do not skew per-token averages."""
  weights = None if tokens is None else tokens / jnp.maximum(jnp.sum(tokens), 1.0)

  def reduce(path, x):
    name = jax.tree_util.keystr(path)
    if name.endswith("_max']"):
      return jnp.max(x)
    if name.endswith("_min']"):
      return jnp.min(x)
    return jnp.mean(x) if weights is None else jnp.sum(weights * x)
  return jax.tree_util.tree_map_with_path(reduce, stacked)


def staleness_metrics(log_ratio, loss_mask, token_lag):
  """Ratio statistics of the policy at the start of the batch against the
  behaviour policy, overall and per token-lag bucket (lag 0 is trainer/
  inference mismatch alone: `abs_log_ratio_lag*`, `ess_lag*`, the adaptive
  staleness bound's input); plus the fraction of tokens in each bucket. An
  empty bucket's ESS reads 1 (its token fraction says it is empty)."""
  log_ratio = jnp.where(loss_mask > 0, log_ratio, 0.0)  # masked columns may hold NaN
  metrics = losses_lib.ratio_statistics(log_ratio, loss_mask)
  metrics["kl_behaviour"] = losses_lib.masked_mean(jnp.exp(log_ratio) - 1 - log_ratio,
                                                   loss_mask)
  total = jnp.maximum(jnp.sum(loss_mask), 1.0)
  for name, lo, hi in LAG_BUCKETS:
    in_bucket = loss_mask * ((token_lag >= lo) & (token_lag <= hi))
    metrics[f"abs_log_ratio_lag{name}"] = losses_lib.masked_mean(jnp.abs(log_ratio), in_bucket)
    metrics[f"ess_lag{name}"] = losses_lib.ratio_statistics(log_ratio, in_bucket)["ess"]
    metrics[f"token_fraction_lag{name}"] = jnp.sum(in_bucket) / total
  return metrics


def _critic_targets(logp, values, mb, token_lag, s: loss_settings_lib.LossSettings):
  """V-trace targets from the critic: per-token policy-gradient advantages
  and the value loss `0.5 (v_s - V)^2` (targets are constants), truncated at
  the policy loss's per-token levels. Explained variance is per microbatch,
  then token-weighted (exact with one)."""
  mask = mb.loss_mask
  on = mask > 0
  knobs = s.knob(s.entry.knobs)  # (the critic's loss's: V-trace's lam, rho_bar, c_bar)
  log_rhos = jnp.where(on, jax.lax.stop_gradient(logp - mb.behaviour_logprobs), 0.0)
  rewards = vtrace_lib.last_token_rewards(mb.rewards, mask, mb.segment_ids)
  vs, advantages = vtrace_lib.vtrace_targets(
      values, rewards, log_rhos, mask, lam=knobs.lam,
      rho_bar=losses_lib.truncation_level(knobs.rho_bar, token_lag, s.objective.age_decay),
      c_bar=losses_lib.truncation_level(knobs.c_bar, token_lag, s.objective.age_decay),
      segment_ids=mb.segment_ids)
  value_loss = jnp.where(on, 0.5 * jnp.square(vs - values), 0.0)
  error_var = segments_lib.masked_variance(vs - values, mask)
  target_var = segments_lib.masked_variance(vs, mask)
  metrics = {"value_loss": losses_lib.masked_mean(value_loss, mask),
             "value_mean": losses_lib.masked_mean(values, mask),
             "explained_variance": 1.0 - error_var / jnp.maximum(target_var, 1e-8)}
  return advantages, value_loss, metrics


def _objective(params, micro, weights, *, logprobs_fn,
               settings: loss_settings_lib.LossSettings, one_step: bool):
  """The weighted loss of one microbatch and its metrics (`train_step`).

  `one_step`: a single optimizer step per batch, so these log-probs are the
  start policy's (their ratio to the behaviour's is the staleness metric).
  """
  s = settings
  mb = micro["batch"]
  o = s.objective
  if o.critic:
    logp, entropy, values = logprobs_fn(params, mb, with_values=True)
    advantages, value_loss, critic_metrics = _critic_targets(logp, values, mb,
                                                             micro["token_lag"], s)
  else:
    logp, entropy = logprobs_fn(params, mb)
    advantages, value_loss, critic_metrics = micro["advantages"], 0.0, {}
  proximal = micro.get("proximal")
  if proximal is None and s.is_decoupled:  # one optimizer step: these params are pi_prox
    proximal = jax.lax.stop_gradient(logp)
  per_token, metrics = s.entry.fn(
      logp, mb.behaviour_logprobs, advantages, mb.loss_mask, proximal_logprobs=proximal,
      token_lag=micro["token_lag"], segment_ids=mb.segment_ids,
      **s.loss_knobs(micro.get("minibatch_keep")))
  metrics.update(critic_metrics)
  on = mb.loss_mask > 0
  vf_coef = s.knob(s.entry.knobs).vf_coef if o.critic else 0.0
  total = per_token + vf_coef * value_loss - o.entropy_coef * jnp.where(on, entropy, 0.0)
  if "reference" in micro:
    kl = losses_lib.kl_to_reference(logp, micro["reference"], mb.loss_mask)
    total = total + o.kl_coef * kl
    metrics["kl_reference"] = losses_lib.masked_mean(kl, mb.loss_mask)
  metrics["entropy"] = losses_lib.masked_mean(entropy, mb.loss_mask)
  if one_step:
    metrics["start_log_ratio"] = jax.lax.stop_gradient(
        jnp.where(on, logp - mb.behaviour_logprobs, 0.0))
  return jnp.sum(weights * total), metrics


def train_step(state: train_state_lib.TrainState, batch: train_batch_lib.TrainBatch,
               reference_params=None, *, frozen=None, graphdef, optimizer, settings):
  """Trains on one batch of (possibly version-mixed) rollouts.

  Args:
    state: the learner state; `state.step` is the version `u` being updated,
      `state.params` what trains (the whole model, or its LoRA adapters).
    batch: `B_u`.
    reference_params: the reference policy's, laid out like `state.params`
      (needed iff kl_coef > 0).
    frozen: what does not train (a LoRA run's base: `lora.split`), or None.

  Returns `(new_state, metrics)`; metrics are float32 scalars.
  """
  s = settings
  if (s.objective.kl_coef > 0) != (reference_params is not None):
    raise ValueError("reference_params must be given exactly when kl_coef > 0")

  def logprobs(params, rows, with_values=False):
    return logprobs_lib.token_logprobs_and_entropy(
        graphdef, whole(params, frozen), rows.tokens, rows.segment_ids, rows.positions,
        s.objective.temperature, with_values, **s.scoring.kwargs(s.mesh))

  # Versions since each token was sampled (prompt and observation tokens carry
  # -1 and are masked out of every use).
  token_lag = state.step - batch.token_versions
  rows = {"batch": batch, "token_lag": token_lag, "advantages": batch.advantages}
  n_mb, n_micro = s.layout.num_minibatches, s.layout.num_microbatches

  # Log-probs of the policy at the start of the batch (proximal policy) and of
  # the reference policy, in microbatch slices to bound memory.
  def frozen_logprobs(params, rows=batch, slices=n_mb * n_micro):
    chunks = _split(rows, slices)
    logp = jax.lax.map(lambda chunk: logprobs(params, chunk)[0], chunks)
    return jax.lax.stop_gradient(_unsplit(logp))

  start_logp = frozen_logprobs(state.params) if s.optimizer_steps > 1 else None
  if start_logp is not None:
    rows["proximal"] = start_logp
  if reference_params is not None:
    rows["reference"] = frozen_logprobs(reference_params)

  grad_fn = jax.value_and_grad(functools.partial(
      _objective, logprobs_fn=logprobs, settings=s, one_step=start_logp is None), has_aux=True)

  minibatches = _split(rows, n_mb)

  def optimizer_step(carry, step_index):
    params, opt_state, skipped = carry
    minibatch = jax.tree.map(lambda x: x[step_index % n_mb], minibatches)
    weights = losses_lib.token_weights(minibatch["batch"].loss_mask, s.objective.aggregation,
                                       s.objective.norm_constant or None,
                                       minibatch["batch"].segment_ids)
    minibatch = {**minibatch, "weights": weights}
    start_ratio = None
    if s.masks_minibatch_first:
      rows = minibatch["batch"]
      start_ratio = jnp.where(
          rows.loss_mask > 0, frozen_logprobs(params, rows, n_micro) - rows.behaviour_logprobs,
          0.0)
      minibatch["minibatch_keep"] = s.minibatch_keep(start_ratio, rows.loss_mask)
    micro = _split(minibatch, n_micro)

    def accumulate(acc, m):
      (loss, metrics), grads = grad_fn(params, m, m["weights"])
      return jax.tree.map(jnp.add, acc, (loss, grads)), metrics

    zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), metrics = jax.lax.scan(accumulate, zero, micro)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite, grad_norm = _finite_and_norm(loss, grads)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    start_log_ratio = metrics.pop("start_log_ratio", None)
    metrics = _combine(metrics, jnp.sum(micro["batch"].loss_mask, axis=(1, 2)))
    if s.masks_minibatch_first:  # a mean over kept tokens: exact from the minibatch's mask
      metrics["m2_kept"] = losses_lib.masked_mean(jnp.square(start_ratio),
                                                  minibatch["minibatch_keep"])
    metrics.update(loss=loss, grad_norm=grad_norm,
                   update_norm=jnp.where(finite, optax.global_norm(updates), 0.0))
    carry = (keep(new_params, params), keep(new_opt_state, opt_state),
             skipped + (~finite).astype(jnp.int32))
    return carry, (metrics, start_log_ratio)

  (params, opt_state, skipped), (metrics, start_log_ratios) = jax.lax.scan(
      optimizer_step, (state.params, state.opt_state, jnp.zeros((), jnp.int32)),
      jnp.arange(s.optimizer_steps))
  metrics = _combine(metrics)  # optimizer steps count equally
  if start_logp is not None:
    start_log_ratio = jnp.where(batch.loss_mask > 0, start_logp - batch.behaviour_logprobs,
                                0.0)
  else:  # the single optimizer step's microbatches, back in row order
    start_log_ratio = _unsplit(start_log_ratios[0])
  metrics.update(staleness_metrics(start_log_ratio, batch.loss_mask, token_lag))
  metrics.update(skipped_steps=skipped, optimizer_steps=jnp.asarray(s.optimizer_steps),
                 trained_tokens=jnp.sum(batch.loss_mask))
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, jax.tree.map(lambda x: x.astype(jnp.float32), metrics)


def _finite_and_norm(loss, grads):
  """Whether the loss and every gradient are finite, and the gradients' norm.

  Every gradient is finite when their global norm is (a norm that overflows
  float32, |g| ~ 1e19, counts as not finite: its update would be). Not an
  `all` over the leaves' own checks: XLA copies that chain of ands into every
  leaf's `where` that keeps or drops the update, a program quadratic in the
  leaves (SmolLM2's update: 0.5M lines of HLO, an executable holding 0.8 GiB
  of host memory, ~45 s more to compile; `tests/learner/update_test.py`).
  """
  grad_norm = optax.global_norm(grads)
  return jnp.isfinite(loss) & jnp.isfinite(grad_norm), grad_norm


def whole(params, frozen):
  """The model's params from its trainable `params` and `frozen` ones (None:
  nothing is frozen)."""
  return params if frozen is None else lora_lib.merge(params, frozen)


def _unsplit(x):
  """Inverse of `_split` for one array `[n, B / n, ...] -> [B, ...]`."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def batch_shardings(mesh: Mesh) -> train_batch_lib.TrainBatch:
  """Rows sharded over the learner's `fsdp` axis (data parallel), columns whole."""
  rows = NamedSharding(mesh, P("fsdp" if "fsdp" in mesh.axis_names else None))
  fields = {f.name: rows for f in dataclasses.fields(train_batch_lib.TrainBatch)}
  return train_batch_lib.TrainBatch(**fields)


def make_update_fn(*, graphdef, optimizer, settings: loss_settings_lib.LossSettings | None,
                   state_shardings, mesh: Mesh, step_fn=train_step, reference_params=None,
                   frozen=None, fingerprint_params: bool = False):
  """Jits `step_fn` with explicit shardings and a donated state.

  Returns `update(state, batch) -> (state, metrics)`; `reference_params`
  (laid out like the state's params) are passed to every step when given,
  and so are the `frozen` params (a LoRA run's base: never donated, never
  trained). A `step_fn` wrapped by a `trace_counter.TraceCounter` counts
  its compiles. With `fingerprint_params` (a run that records or replays its
  schedule), `metrics[PARAMS_SUMS]` holds `fingerprint.sums_of` the new
  params, computed in the same program: as a program of its own, with a
  wait of its own, it took 3.3 ms an update inside a recorded arith run
  (0.5 alone: the wait queued behind the sampler's work;
  `benchmarks/replay.py`).
  """
  if settings is not None:
    settings = dataclasses.replace(settings, mesh=mesh)
  if frozen is not None and not jax.tree.leaves(frozen):
    frozen = None  # (full fine-tuning: nothing is frozen)

  def step(state, batch, frozen, *reference):
    state, metrics = step_fn(state, batch, *reference, frozen=frozen, graphdef=graphdef,
                             optimizer=optimizer, settings=settings)
    if fingerprint_params:
      metrics = {**metrics, PARAMS_SUMS: fingerprint.sums_of(state.params)}
    return state, metrics

  rows = batch_shardings(mesh)
  frozen_shardings = None if frozen is None else jax.tree.map(lambda x: x.sharding, frozen)
  in_shardings = (state_shardings, rows, frozen_shardings) + (
      () if reference_params is None else (state_shardings.params,))
  jitted = jax.jit(step, in_shardings=in_shardings,
                   out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)
  extra = (frozen,) + (() if reference_params is None else (reference_params,))

  def update(state, batch):
    # Host rows placed explicitly: jit takes host arrays only for replicated
    # inputs when the mesh spans processes (each process fills its shards
    # from its copy of the whole batch).
    return jitted(state, jax.device_put(batch, rows), *extra)

  update.lower = lambda state, batch: jitted.lower(state, batch, *extra)  # memory analysis
  return update
