"""The jitted, sharded, donated update step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arl_jax.core import train_batch as train_batch_lib
from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.learner import loss_settings
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.learner import update as update_lib
from arl_jax.models import fingerprint
from arl_jax.sampler import trace_counter
from arl_jax.sharding import mesh_lib
from arl_jax.testing import tiny
from arl_jax.training import learner_loop

PAD = 256


def _random_batch(rng, rows=8, prompt_len=6, new=6):
  tokens, mask = tiny.random_prompts(rows, prompt_len, PAD, seed=int(rng.integers(1 << 30)))
  completion = rng.integers(0, 256, (rows, new)).astype(np.int32)
  loss_mask = np.ones((rows, new), np.float32)
  return train_batch_lib.from_rows(
      tokens=np.concatenate([tokens, completion], 1),
      token_mask=np.concatenate([mask, np.ones((rows, new), bool)], 1),
      loss_mask=np.concatenate([np.zeros((rows, prompt_len), np.float32), loss_mask], 1),
      behaviour_logprobs=np.concatenate(
          [np.zeros((rows, prompt_len), np.float32),
           rng.normal(-5.5, 0.1, (rows, new)).astype(np.float32)], 1),
      token_versions=np.zeros((rows, prompt_len + new), np.int32),
      advantages=rng.normal(size=rows).astype(np.float32), rewards=np.zeros(rows, np.float32))


def _on_tokens(batch, per_row):
  """Per-row values on each row's tokens (a TrainBatch's advantages, rewards)."""
  return (batch.token_mask * np.asarray(per_row, np.float32)[:, None]).astype(np.float32)


def _setup(traces=None, meshes=None, **model):
  """`(state, update_fn, meshes)`; `traces` (a TraceCounter) counts the step's
  compiles; `model` overrides the tiny model's config."""
  cfg = tiny.tiny_model_config(**model)
  meshes = meshes or tiny.role_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig(lr=1e-3))
  state, shardings = train_state_lib.create(params, optimizer, meshes.learner)
  step_fn = update_lib.train_step if traces is None else traces.wrap(update_lib.train_step)
  update_fn = update_lib.make_update_fn(
      graphdef=graphdef, optimizer=optimizer, settings=loss_settings.LossSettings.of(),
      state_shardings=shardings, mesh=meshes.learner, step_fn=step_fn)
  return state, update_fn, meshes


def test_the_update_program_grows_linearly_with_the_parameter_leaves():
  """Regression: the check that every gradient is finite, written as an `all`
  over the leaves' own checks, was copied by XLA into every leaf's update (a
  program quadratic in the leaves: SmolLM2's held 0.8 GiB of host memory and
  compiled ~4x slower). 8x the layers must make at most 8x the program
  (measured: 4.8x; 9.4x with the quadratic check)."""
  sizes = []
  for layers in (1, 8):
    state, update_fn, _ = _setup(meshes=tiny.single_device_meshes(), num_layers=layers)
    batch = _random_batch(np.random.default_rng(0))
    sizes.append(len(update_fn.lower(state, batch).compile().as_text()))
  assert sizes[1] < 8 * sizes[0], sizes


def test_a_recording_update_returns_its_new_params_fingerprint_sums():
  """`fingerprint_params`: the update program computes the fingerprint's sums
  of the params it returns (a recorded run's `params_hash`, no program or
  wait of its own), equal to fingerprinting them afterwards."""
  cfg = tiny.tiny_model_config()
  meshes = tiny.role_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig(lr=1e-3))
  state, shardings = train_state_lib.create(params, optimizer, meshes.learner)
  update_fn = update_lib.make_update_fn(
      graphdef=graphdef, optimizer=optimizer, settings=loss_settings.LossSettings.of(),
      state_shardings=shardings, mesh=meshes.learner, fingerprint_params=True)
  before = fingerprint.fingerprint(state.params)
  state, metrics = update_fn(state, _random_batch(np.random.default_rng(0)))
  sums = jax.device_get(metrics.pop(update_lib.PARAMS_SUMS))
  assert fingerprint.from_sums(state.params, sums) == fingerprint.fingerprint(state.params)
  assert fingerprint.from_sums(state.params, sums) != before  # (the params moved)


def test_scanned_rematerialised_blocks_give_the_same_update_up_to_rounding():
  """`learner.scan_layers` and `remat` change what the backward pass keeps,
  not the arithmetic: `configs/smollm2.py` takes them for their memory on
  that promise. Rounding may differ (~1e-6 here: XLA fuses the scanned body
  apart), a thousandth of what the updates move."""
  cfg = tiny.tiny_model_config(num_layers=3, d_model=64, mlp_dim=128)
  meshes = tiny.single_device_meshes()
  batch = _random_batch(np.random.default_rng(0))
  _, start, _ = tiny.learner_and_sampler_params(cfg, meshes)
  start = jax.tree.leaves(jax.tree.map(np.asarray, start))

  def params_after_two_updates(**scoring):
    graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
    optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig(lr=1e-3))
    state, shardings = train_state_lib.create(params, optimizer, meshes.learner)
    update_fn = update_lib.make_update_fn(
        graphdef=graphdef, optimizer=optimizer, state_shardings=shardings,
        settings=loss_settings.LossSettings.of(num_microbatches=2, **scoring),
        mesh=meshes.learner)
    for _ in range(2):
      state, _ = update_fn(state, batch)
    return jax.tree.leaves(jax.tree.map(np.asarray, state.params))

  largest = lambda xs, ys: max(float(np.max(np.abs(x - y))) for x, y in zip(xs, ys))
  unrolled = params_after_two_updates()
  moved = largest(unrolled, start)
  assert moved > 1e-4
  for scoring in (dict(scan_layers=True, remat="block"), dict(remat="dots")):
    assert largest(params_after_two_updates(**scoring), unrolled) < 1e-3 * moved, scoring


def _layout(state):
  return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), state)


def test_update_keeps_shardings_and_dtypes_and_compiles_once():
  traces = trace_counter.TraceCounter()
  state, update_fn, meshes = _setup(traces)
  before = _layout(state)
  # Params really are sharded over the learner's 4-way fsdp axis.
  embed = state.params["embed"][...]
  assert embed.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
  assert len(embed.addressable_shards) == 4
  assert embed.addressable_shards[0].data.shape == (259, 8)
  rng = np.random.default_rng(0)
  for _ in range(3):
    state, metrics = update_fn(state, _random_batch(rng))
  assert _layout(state) == before
  assert int(state.step) == 3
  assert traces.count == 1
  assert np.isfinite(float(metrics["loss"]))
  assert float(metrics["grad_norm"]) > 0


def _bytes_per_device(tree) -> dict:
  out = {}
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
  return out


def test_adam_moments_are_sharded_like_the_params_they_mirror():
  state, update_fn, _ = _setup()
  params, moments = _bytes_per_device(state.params), _bytes_per_device(state.opt_state)
  # Two moments per parameter on each of the 4 fsdp devices (and a few scalars),
  # not a replica of every moment on every device.
  assert set(moments) == set(params) and len(params) == 4
  for device, size in params.items():
    assert 2 * size <= moments[device] <= 2 * size + 64, (device, size, moments[device])
  mu = state.opt_state[1][0].mu  # (clip, then AdamW's scale_by_adam state)
  assert jax.tree.map(lambda x: x.sharding, mu) == jax.tree.map(lambda x: x.sharding,
                                                                state.params)
  state, _ = update_fn(state, _random_batch(np.random.default_rng(0)))
  assert _bytes_per_device(state.opt_state) == moments  # (the update keeps the layout)


def test_update_donates_the_old_state():
  state, update_fn, _ = _setup()
  old_embed = state.params["embed"][...]
  state, _ = update_fn(state, _random_batch(np.random.default_rng(1)))
  assert old_embed.is_deleted()


def test_update_moves_logprobs_in_the_direction_of_the_advantage():
  state, update_fn, _ = _setup()
  batch = _random_batch(np.random.default_rng(2))
  batch = batch.replace(advantages=_on_tokens(batch, np.where(np.arange(8) < 4, 1.0, -1.0)))
  metrics_0 = None
  for _ in range(5):
    state, metrics = update_fn(state, batch)
    metrics_0 = metrics_0 or metrics
  # Loss is -mean(rho A): it must go down as rho grows on A>0 and shrinks on A<0.
  assert float(metrics["loss"]) < float(metrics_0["loss"])


def test_kl_metric_is_the_k3_estimator_of_kl_behaviour_to_policy():
  state, update_fn, _ = _setup()
  batch = _random_batch(np.random.default_rng(3))
  graphdef, _, _ = tiny.learner_and_sampler_params(tiny.tiny_model_config(), tiny.role_meshes())
  logp, _ = logprobs_lib.token_logprobs_and_entropy(graphdef, state.params, batch.tokens,
                                                    batch.segment_ids, batch.positions, 1.0)
  log_ratio = (np.asarray(logp) - batch.behaviour_logprobs) * batch.loss_mask
  # Tokens were drawn from mu: E_mu[r - 1 - log r] with r = pi / mu is KL(mu || pi).
  expected = np.sum((np.exp(log_ratio) - 1 - log_ratio) * batch.loss_mask) / batch.loss_mask.sum()
  _, metrics = update_fn(state, batch)
  np.testing.assert_allclose(float(metrics["kl_behaviour"]), expected, rtol=1e-4)


def _state_and_update(settings, mesh, *, optimizer=None, reference=False, seed=0, traces=None):
  # vocab divisible by tp = 2; a value head iff the loss trains a critic.
  cfg = tiny.tiny_model_config(vocab_size=260, value_head=settings.objective.critic)
  graphdef, params, _ = tiny.learner_and_sampler_params(
      cfg, mesh_lib.RoleMeshes(learner=mesh, sampler=mesh), seed=seed)
  optimizer = optimizer or optax.sgd(0.1)
  state, shardings = train_state_lib.create(params, optimizer, mesh)
  ref = jax.tree.map(jnp.copy, params) if reference else None
  step_fn = update_lib.train_step if traces is None else traces.wrap(update_lib.train_step)
  update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer, settings=settings,
                                        state_shardings=shardings, mesh=mesh,
                                        reference_params=ref, step_fn=step_fn)
  return graphdef, state, update_fn


def _mesh(shape):
  devices = np.array(jax.devices()[:int(np.prod([s for _, s in shape]))])
  return jax.sharding.Mesh(devices.reshape([s for _, s in shape]), [n for n, _ in shape])


def _host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def test_several_optimizer_steps_per_batch_compile_once_and_count_one_version():
  settings = loss_settings.LossSettings.of(num_epochs=2, num_minibatches=2, num_microbatches=2)
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  traces = trace_counter.TraceCounter()
  _, state, update_fn = _state_and_update(settings, mesh, optimizer=optax.adam(1e-3),
                                          traces=traces)
  before = _layout(state)
  rng = np.random.default_rng(4)
  for _ in range(2):
    state, metrics = update_fn(state, _random_batch(rng))
  assert _layout(state) == before and int(state.step) == 2
  assert traces.count == 1
  assert float(metrics["optimizer_steps"]) == 4 and float(metrics["skipped_steps"]) == 0
  # The optimizer really took 4 steps per batch.
  assert int(jax.tree.leaves(state.opt_state)[0]) == 8
  # The decoupled weight pi_prox / mu is reported, and at the first step the
  # proximal policy is the current one, so no ratio is clipped then.
  assert np.isfinite(float(metrics["behaviour_weight_mean"]))


def _ragged(batch):
  """Different numbers of trained tokens per row, and one row with none."""
  loss_mask = batch.loss_mask.copy()
  for row in range(loss_mask.shape[0]):
    loss_mask[row, loss_mask.shape[1] - row:] = 0.0
  return batch.replace(loss_mask=loss_mask)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
def test_gradient_accumulation_matches_one_pass(aggregation):
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  batch = _ragged(_random_batch(np.random.default_rng(5)))
  assert batch.loss_mask[7].sum() == 0 and batch.loss_mask[1].sum() == 5
  results = []
  for micro in (1, 4):
    settings = loss_settings.LossSettings.of(num_microbatches=micro, aggregation=aggregation,
                                       norm_constant=6.0)
    _, state, update_fn = _state_and_update(settings, mesh)
    state, metrics = update_fn(state, batch)
    results.append((_host(state.params), {k: float(v) for k, v in metrics.items()}))
  (p1, m1), (p4, m4) = results
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p4)
  # Per-token metrics are weighted by tokens, whatever the microbatching.
  for key in ("loss", "entropy", "clip_fraction", "ratio_mean", "kl_behaviour", "grad_norm"):
    np.testing.assert_allclose(m1[key], m4[key], rtol=1e-4, err_msg=key)


def test_m2po_masks_the_whole_minibatch_before_accumulating_microbatches():
  """The second-moment mask is over the minibatch (a stop-gradient pass
  first), so 4 microbatches train exactly as one pass: a mask per microbatch
  would keep different tokens."""
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  batch = _ragged(_random_batch(np.random.default_rng(6)))
  results = []
  for micro in (1, 4):
    settings = loss_settings.LossSettings.of(loss="m2po", tau=0.012, num_microbatches=micro)
    _, state, update_fn = _state_and_update(settings, mesh)
    state, metrics = update_fn(state, batch)
    results.append((_host(state.params), {k: float(v) for k, v in metrics.items()}))
  (p1, m1), (p4, m4) = results
  assert 0.05 < m1["masked_fraction"] < 0.95
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p4)
  for key in ("loss", "masked_fraction", "m2_kept", "grad_norm", "entropy"):
    np.testing.assert_allclose(m1[key], m4[key], rtol=1e-4, err_msg=key)


def test_non_finite_loss_skips_the_step_and_keeps_the_state():
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  _, state, update_fn = _state_and_update(loss_settings.LossSettings.of(), mesh,
                                          optimizer=optax.adam(1e-3))
  params_before, opt_before = _host(state.params), _host(state.opt_state)
  batch = _random_batch(np.random.default_rng(6))
  bad = batch.behaviour_logprobs.copy()
  bad[0, -1] = np.nan
  state, metrics = update_fn(state, batch.replace(behaviour_logprobs=bad))
  assert float(metrics["skipped_steps"]) == 1 and float(metrics["update_norm"]) == 0
  jax.tree.map(np.testing.assert_array_equal, _host(state.params), params_before)
  jax.tree.map(np.testing.assert_array_equal, _host(state.opt_state), opt_before)
  assert int(state.step) == 1  # the version still advances: the batch was consumed
  state, metrics = update_fn(state, batch)  # and the next good batch trains
  assert float(metrics["skipped_steps"]) == 0 and float(metrics["update_norm"]) > 0


@pytest.mark.parametrize("loss", ["clipped_ratio", "vtrace", "m2po"])
def test_one_step_raises_the_logprob_of_a_positive_advantage_token(loss):
  mesh = _mesh((("fsdp", 1), ("tp", 1)))
  graphdef, state, update_fn = _state_and_update(loss_settings.LossSettings.of(loss=loss), mesh)
  batch = _random_batch(np.random.default_rng(7), rows=2)
  # One trained token per row; behaviour = the current policy (on-policy).
  logp, _ = logprobs_lib.token_logprobs_and_entropy(graphdef, state.params, batch.tokens,
                                                    batch.segment_ids, batch.positions, 1.0)
  loss_mask = np.zeros_like(batch.loss_mask)
  loss_mask[:, -3] = 1
  batch = batch.replace(loss_mask=loss_mask, advantages=_on_tokens(batch, [1.0, -1.0]),
                        behaviour_logprobs=np.asarray(logp) * loss_mask)
  before = np.asarray(logp)[:, -3]
  state, _ = update_fn(state, batch)
  after, _ = logprobs_lib.token_logprobs_and_entropy(graphdef, state.params, batch.tokens,
                                                     batch.segment_ids, batch.positions, 1.0)
  after = np.asarray(after)[:, -3]
  assert after[0] > before[0] and after[1] < before[1]


def test_kl_to_reference_policy():
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  settings = loss_settings.LossSettings.of(kl_coef=0.1)
  _, state, update_fn = _state_and_update(settings, mesh, reference=True)
  rng = np.random.default_rng(8)
  state, metrics = update_fn(state, _random_batch(rng))
  assert float(metrics["kl_reference"]) == pytest.approx(0.0, abs=1e-6)  # still the reference
  state, metrics = update_fn(state, _random_batch(rng))
  assert float(metrics["kl_reference"]) > 0
  with pytest.raises(ValueError, match="reference_params"):
    _state_and_update(settings, mesh)[2](state, _random_batch(rng))


def test_staleness_metrics_split_the_log_ratio_by_token_lag():
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  graphdef, state, update_fn = _state_and_update(loss_settings.LossSettings.of(), mesh)
  batch = _random_batch(np.random.default_rng(9))
  logp, _ = logprobs_lib.token_logprobs_and_entropy(graphdef, state.params, batch.tokens,
                                                    batch.segment_ids, batch.positions, 1.0)
  # Rows 0-3 were sampled by the current policy (version 0, exact log-probs);
  # rows 4-7 by a version "-2" whose log-probs differ by 0.5 on every token.
  behaviour = np.asarray(logp) * batch.loss_mask
  behaviour[4:] -= 0.5 * batch.loss_mask[4:]
  versions = np.where(np.arange(8)[:, None] < 4, 0, -2) * np.ones_like(batch.token_versions)
  _, metrics = update_fn(state, batch.replace(behaviour_logprobs=behaviour,
                                              token_versions=versions.astype(np.int32)))
  assert float(metrics["abs_log_ratio_lag0"]) == pytest.approx(0.0, abs=1e-5)
  assert float(metrics["abs_log_ratio_lag2"]) == pytest.approx(0.5, rel=1e-4)
  assert float(metrics["token_fraction_lag0"]) == pytest.approx(0.5)
  assert float(metrics["token_fraction_lag2"]) == pytest.approx(0.5)
  assert float(metrics["ratio_max"]) == pytest.approx(np.exp(0.5), rel=1e-4)
  assert 0 < float(metrics["ess"]) < 1
  # Per lag the ratios are equal (1, and e^0.5), so each bucket's ESS is 1
  # while the batch's is not; an empty bucket reads 1 too.
  for name in ("0", "1", "2"):
    assert float(metrics[f"ess_lag{name}"]) == pytest.approx(1.0, abs=1e-5)
  # What the adaptive staleness bound reads of them (`learner_loop.lag_stats`;
  # tests/orchestrator/adaptive_staleness_test.py assumes these buckets).
  stats = learner_loop.lag_stats(jax.device_get(metrics))
  assert [(s.lo, s.hi) for s in stats] == [*((lag, lag) for lag in range(9)), (9, 1 << 30)]
  assert stats[2].tokens == pytest.approx(0.5 * float(metrics["trained_tokens"]))
  assert stats[1].tokens == 0.0


def test_same_loss_and_update_on_one_device_and_on_fsdp2_tp2():
  batch = _random_batch(np.random.default_rng(10))
  results = []
  for shape in ((("fsdp", 1), ("tp", 1)), (("fsdp", 2), ("tp", 2))):
    settings = loss_settings.LossSettings.of(num_minibatches=2)
    _, state, update_fn = _state_and_update(settings, _mesh(shape))
    state, metrics = update_fn(state, batch)
    results.append((_host(state.params), {k: float(v) for k, v in metrics.items()}))
  (p1, m1), (p4, m4) = results
  for key in ("loss", "grad_norm", "ratio_mean", "entropy", "update_norm"):
    np.testing.assert_allclose(m1[key], m4[key], rtol=1e-4, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p1, p4)


def test_the_critic_is_trained_toward_the_vtrace_targets_of_its_own_values():
  from arl_jax.learner import vtrace as vtrace_lib
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  settings = loss_settings.LossSettings.of(loss="vtrace", critic=True, lam=0.8, rho_bar=1.5)
  graphdef, state, update_fn = _state_and_update(settings, mesh, optimizer=optax.sgd(0.0))
  # Give the zero-initialised head some values first.
  state = state.replace(params=jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.3 if "value_head" in jax.tree_util.keystr(path) else x,
      state.params))
  batch = _ragged(_random_batch(np.random.default_rng(12)))
  batch = batch.replace(rewards=_on_tokens(batch, np.linspace(0, 1, 8)))
  logp, _, values = logprobs_lib.token_logprobs_and_entropy(
      graphdef, state.params, batch.tokens, batch.segment_ids, batch.positions, 1.0,
      with_values=True)
  mask = batch.loss_mask
  log_rhos = (np.asarray(logp) - batch.behaviour_logprobs) * mask
  rewards = vtrace_lib.last_token_rewards(batch.rewards, mask, batch.segment_ids)
  vs, _ = vtrace_lib.vtrace_targets(values, rewards, log_rhos, mask, rho_bar=1.5, lam=0.8)
  expected = np.sum(0.5 * (np.asarray(vs) - np.asarray(values)) ** 2 * mask) / mask.sum()
  assert np.std(np.asarray(values)[mask > 0]) > 0  # the values differ per position
  _, metrics = update_fn(state, batch)
  np.testing.assert_allclose(float(metrics["value_loss"]), expected, rtol=1e-4)


def test_vtrace_actor_critic_learns_values_from_the_last_token_reward():
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  settings = loss_settings.LossSettings.of(loss="vtrace", critic=True, lam=0.9, rho_bar=1.5)
  _, state, update_fn = _state_and_update(settings, mesh, optimizer=optax.adam(3e-3))
  batch = _random_batch(np.random.default_rng(11))
  batch = batch.replace(rewards=_on_tokens(batch, np.ones(8)))  # every completion earns 1
  history = []
  for _ in range(30):
    state, metrics = update_fn(state, batch)
    history.append({k: float(v) for k, v in metrics.items()})
  # The zero-initialised critic starts at 0 with value loss > 0 and moves its
  # estimates toward the return 1.
  assert history[0]["value_mean"] == 0.0 and history[0]["value_loss"] > 0.1
  assert history[-1]["value_mean"] > 0.6
  assert history[-1]["value_loss"] < 0.6 * history[0]["value_loss"]
  assert np.isfinite(history[-1]["explained_variance"])
  assert all(h["skipped_steps"] == 0 for h in history)


def test_trimming_padding_columns_changes_nothing():
  """A batch trained at its completions' width (`train_batch.completion_width`)
  updates the params exactly as the same batch padded to the full budget."""
  rng = np.random.default_rng(7)
  short = _random_batch(rng, new=6)
  pad = 10  # columns of pure padding (no token, no loss) after the completions
  padded = train_batch_lib.TrainBatch(**{
      name: np.concatenate([value, np.full((value.shape[0], pad), fill, value.dtype)], 1)
      for name, fill, value in [
          (f, {"tokens": PAD, "token_versions": -1}.get(f, 0), getattr(short, f))
          for f in train_batch_lib.TrainBatch.__dataclass_fields__]})
  results = []
  for batch in (short, padded):
    state, update_fn, _ = _setup()
    state, metrics = update_fn(state, batch)
    results.append((jax.device_get(state.params), float(metrics["loss"])))
  (params_a, loss_a), (params_b, loss_b) = results
  assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
  # Adam's first step moves a parameter by up to lr (1e-3) whatever its gradient's
  # size; padding that leaked into the loss would move them by that much. 1e-5 is
  # float32 rounding of the gradients (summed in another order) through Adam.
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_completion_width_is_a_power_of_two_within_the_budget():
  class _Rollout:
    def __init__(self, n):
      self.completion_length = n

  class _Group:
    def __init__(self, *lengths):
      self.rollouts = [_Rollout(n) for n in lengths]

  width = train_batch_lib.completion_width
  assert width([_Group(3, 5)], 256) == 16  # the floor
  assert width([_Group(3), _Group(17)], 256) == 32  # the longest completion of the batch
  assert width([_Group(200)], 256) == 256
  assert width([_Group(10)], 12) == 12  # never past the budget


def _poison_masked_columns(batch):
  """The batch with NaN, inf and -inf behaviour log-probs on every column it
  does not train on (prompt, padding, the tail of ragged rows)."""
  poison = np.resize(np.array([np.nan, np.inf, -np.inf], np.float32), batch.loss_mask.shape)
  return batch.replace(behaviour_logprobs=np.where(batch.loss_mask > 0,
                                                   batch.behaviour_logprobs, poison))


@pytest.mark.parametrize("settings", [
    loss_settings.LossSettings.of(kl_coef=0.1, entropy_coef=0.01),
    loss_settings.LossSettings.of(num_minibatches=2, tis_cap=2.0, age_decay=0.5),
    loss_settings.LossSettings.of(loss="vtrace", critic=True, rho_bar=1.5, c_bar=1.2, lam=0.9,
                            age_decay=0.5, entropy_coef=0.01),
    loss_settings.LossSettings.of(loss="m2po", tau=0.5),
], ids=["clipped_ratio_kl_entropy", "decoupled", "vtrace_critic", "m2po"])
def test_nan_and_inf_on_masked_columns_do_not_skip_or_change_the_update(settings):
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  _, state, update_fn = _state_and_update(settings, mesh, optimizer=optax.adam(1e-3),
                                          reference=settings.objective.kl_coef > 0)
  batch = _ragged(_random_batch(np.random.default_rng(13)))
  batch = batch.replace(rewards=_on_tokens(batch, np.linspace(0, 1, 8)))
  poisoned = _poison_masked_columns(batch)
  assert not np.all(np.isfinite(poisoned.behaviour_logprobs))
  twin = jax.tree.map(jnp.copy, state)
  state, metrics = update_fn(state, batch)
  twin, bad_metrics = update_fn(twin, poisoned)
  assert float(bad_metrics["skipped_steps"]) == 0 and float(bad_metrics["update_norm"]) > 0
  metrics, bad_metrics = _host(metrics), _host(bad_metrics)
  for key, value in metrics.items():
    assert np.isfinite(bad_metrics[key]), key
    np.testing.assert_allclose(bad_metrics[key], value, rtol=1e-6, atol=1e-9, err_msg=key)
  params, bad_params = _host(state.params), _host(twin.params)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(bad_params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), params,
               bad_params)


def test_the_critic_targets_shrink_their_truncation_levels_with_age_decay():
  """With `age_decay`, the critic's V-trace targets use the policy loss's
  per-token levels `1 + (bar - 1) / (1 + age_decay * lag)` for rho_bar and
  c_bar; at lag 0 they are the plain levels."""
  from arl_jax.learner import vtrace as vtrace_lib
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  rho_bar, c_bar, age_decay = 1.5, 1.3, 1.0
  settings = loss_settings.LossSettings.of(loss="vtrace", critic=True, lam=0.9, rho_bar=rho_bar,
                                     c_bar=c_bar, age_decay=age_decay)
  graphdef, state, update_fn = _state_and_update(settings, mesh, optimizer=optax.sgd(0.0))
  state = state.replace(params=jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.3 if "value_head" in jax.tree_util.keystr(path) else x,
      state.params))
  batch = _ragged(_random_batch(np.random.default_rng(14)))
  batch = batch.replace(rewards=_on_tokens(batch, np.linspace(0, 1, 8)))
  logp, _, values = logprobs_lib.token_logprobs_and_entropy(
      graphdef, state.params, batch.tokens, batch.segment_ids, batch.positions, 1.0,
      with_values=True)
  logp, values, mask = np.asarray(logp), np.asarray(values), batch.loss_mask
  # rho = e^0.4 = 1.49 on every other trained column: under rho_bar = 1.5 and
  # c_bar = 1.3 at lag 0, above both levels at lag 2 (1.1667 and 1.1).
  shift = np.where(np.arange(mask.shape[1]) % 2 == 0, 0.4, -0.1)[None, :]
  batch = batch.replace(behaviour_logprobs=((logp - shift) * mask).astype(np.float32))
  log_rhos = (logp - batch.behaviour_logprobs) * mask
  rewards = vtrace_lib.last_token_rewards(batch.rewards, mask, batch.segment_ids)

  def value_loss(rho_level, c_level):
    vs, _ = vtrace_lib.vtrace_targets(values, rewards, log_rhos, mask, lam=0.9,
                                      rho_bar=rho_level, c_bar=c_level)
    return np.sum(0.5 * (np.asarray(vs) - values) ** 2 * mask) / mask.sum()

  plain = value_loss(rho_bar, c_bar)
  for lag in (0, 2):
    lags = np.full(mask.shape, lag, np.float32)
    expected = value_loss(1 + (rho_bar - 1) / (1 + age_decay * lags),
                          1 + (c_bar - 1) / (1 + age_decay * lags))
    if lag == 0:
      assert expected == plain
    else:  # the decayed levels really truncate (a margin far above the tolerance)
      assert abs(expected - plain) > 1e-2 * plain
    versions = np.where(mask > 0, int(state.step) - lag, -1).astype(np.int32)
    state, metrics = update_fn(state, batch.replace(token_versions=versions))
    np.testing.assert_allclose(float(metrics["value_loss"]), expected, rtol=1e-4,
                               err_msg=f"lag {lag}")
