"""The jitted, sharded, donated update step."""

import jax
import numpy as np

from arl_jax import train_batch as train_batch_lib
from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.learner import update as update_lib
from arl_jax.testing import tiny

PAD = 256


def _random_batch(rng, rows=8, prompt_len=6, new=6):
  tokens, mask = tiny.random_prompts(rows, prompt_len, PAD, seed=int(rng.integers(1 << 30)))
  completion = rng.integers(0, 256, (rows, new)).astype(np.int32)
  loss_mask = np.ones((rows, new), np.float32)
  return train_batch_lib.TrainBatch(
      tokens=np.concatenate([tokens, completion], 1),
      token_mask=np.concatenate([mask, np.ones((rows, new), bool)], 1),
      loss_mask=np.concatenate([np.zeros((rows, prompt_len), np.float32), loss_mask], 1),
      behaviour_logprobs=np.concatenate(
          [np.zeros((rows, prompt_len), np.float32),
           rng.normal(-5.5, 0.1, (rows, new)).astype(np.float32)], 1),
      token_versions=np.zeros((rows, prompt_len + new), np.int32),
      advantages=rng.normal(size=rows).astype(np.float32),
      rewards=np.zeros(rows, np.float32), group_ids=np.arange(rows, dtype=np.int32),
      lag=np.zeros(rows, np.int32))


def _setup():
  cfg = tiny.tiny_model_config()
  meshes = tiny.role_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig(lr=1e-3))
  state, shardings = train_state_lib.create(params, optimizer, meshes.learner)
  update_fn = update_lib.make_update_fn(
      graphdef=graphdef, optimizer=optimizer, settings=update_lib.LossSettings(),
      state_shardings=shardings, mesh=meshes.learner)
  return state, update_fn, meshes


def _layout(state):
  return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), state)


def test_update_keeps_shardings_and_dtypes_and_compiles_once():
  state, update_fn, meshes = _setup()
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
  assert update_fn._cache_size() == 1  # noqa: SLF001
  assert np.isfinite(float(metrics["loss"]))
  assert float(metrics["grad_norm"]) > 0


def test_update_donates_the_old_state():
  state, update_fn, _ = _setup()
  old_embed = state.params["embed"][...]
  state, _ = update_fn(state, _random_batch(np.random.default_rng(1)))
  assert old_embed.is_deleted()


def test_update_moves_logprobs_in_the_direction_of_the_advantage():
  state, update_fn, _ = _setup()
  batch = _random_batch(np.random.default_rng(2))
  batch = batch.replace(advantages=np.where(np.arange(8) < 4, 1.0, -1.0).astype(np.float32))
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
                                                    batch.token_mask, 1.0)
  log_ratio = (np.asarray(logp) - batch.behaviour_logprobs) * batch.loss_mask
  # Tokens were drawn from mu: E_mu[r - 1 - log r] with r = pi / mu is KL(mu || pi).
  expected = np.sum((np.exp(log_ratio) - 1 - log_ratio) * batch.loss_mask) / batch.loss_mask.sum()
  _, metrics = update_fn(state, batch)
  np.testing.assert_allclose(float(metrics["kl_behaviour"]), expected, rtol=1e-4)
