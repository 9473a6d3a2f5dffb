"""Packed rows train exactly as padded rows: same loss, metrics and gradients
for every loss and aggregation, with multi-turn rows (observation tokens
inside completions), tokens of mixed versions, minibatches and microbatches;
and the learner's log-probs of packed rows equal the sampler's records."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arl_jax.core import packing as packing_lib
from arl_jax.core import train_batch as train_batch_lib
from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.learner import loss_settings
from arl_jax.learner import train_state as train_state_lib
from arl_jax.learner import update as update_lib
from arl_jax.sharding import mesh_lib
from arl_jax.testing import tiny
from tests.core.packing_test import random_groups

FSDP = 2
KW = dict(prompt_len=8, max_new_tokens=24, pad_id=256, advantage_estimator="grpo")

CASES = {
    "clipped_ratio": loss_settings.LossSettings.of(entropy_coef=0.01),
    "clipped_ratio_seq_mean_minibatches": loss_settings.LossSettings.of(
        aggregation="seq_mean_token_mean", num_minibatches=2, num_microbatches=2, num_epochs=2),
    "clipped_ratio_seq_sum_age": loss_settings.LossSettings.of(
        aggregation="seq_sum_norm", norm_constant=24.0, age_decay=0.5, dual_clip=3.0),
    "vtrace": loss_settings.LossSettings.of(loss="vtrace", rho_bar=1.5),
    "vtrace_critic": loss_settings.LossSettings.of(loss="vtrace", critic=True, lam=0.9, rho_bar=1.5,
                                             c_bar=1.2),
    "m2po_microbatches": loss_settings.LossSettings.of(loss="m2po", tau=0.5, num_microbatches=2),
}


def _mesh(tp=1):
  return jax.sharding.Mesh(np.array(jax.devices()[:FSDP * tp]).reshape(FSDP, tp), ("fsdp", "tp"))


def _train(settings, batch, step=2, tp=1):
  """`(param deltas, metrics)` of one update with SGD at rate 1 (the deltas
  are minus the summed gradients) from a fixed start at version `step`."""
  mesh = _mesh(tp)
  cfg = tiny.tiny_model_config(vocab_size=260, value_head=settings.objective.critic)
  graphdef, params, _ = tiny.learner_and_sampler_params(
      cfg, mesh_lib.RoleMeshes(learner=mesh, sampler=mesh), seed=0)
  if settings.objective.critic:  # values that differ per position, not the zero init
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.3 if "value_head" in jax.tree_util.keystr(path) else x, params)
  before = jax.device_get(params)
  optimizer = optax.sgd(1.0)
  state, shardings = train_state_lib.create(params, optimizer, mesh)
  state = state.replace(step=jnp.asarray(step, state.step.dtype))
  update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer,
                                        settings=settings, state_shardings=shardings, mesh=mesh)
  state, metrics = update_fn(state, batch)
  deltas = jax.tree.map(lambda a, b: np.asarray(a) - b, jax.device_get(state.params), before)
  return deltas, jax.device_get(metrics)


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_loss_metrics_and_gradients_equal_padded(case):
  settings = CASES[case]
  groups = random_groups(np.random.default_rng(5), num_groups=4)
  padded = train_batch_lib.assemble(groups, **KW)
  packing = packing_lib.Packing(pack_len=32, num_slices=settings.layout.num_minibatches,
                                row_multiple=settings.layout.num_microbatches * FSDP)
  packed = train_batch_lib.assemble(groups, packing=packing, **KW)
  assert packed.tokens.size <= padded.tokens.size
  assert (packed.segment_ids.max(axis=1) > 1).any()  # and rows do hold several rollouts
  want_deltas, want = _train(settings, padded)
  got_deltas, got = _train(settings, packed)
  assert set(got) == set(want)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
  assert want["loss"] != 0 and want["grad_norm"] > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               got_deltas, want_deltas)


@pytest.mark.parametrize("kernel", ["splash_interpret", "pallas_gpu_interpret"])
def test_attention_kernels_train_sharded_packed_rows_as_the_xla_path(kernel):
  """The TPU and GPU kernels (Pallas interpret mode) run per device in a
  shard_map (rows over fsdp, heads over tp) under an fsdp 2 x tp 2 learner
  mesh: the same loss, metrics and gradients as XLA's attention."""
  groups = random_groups(np.random.default_rng(5), num_groups=4)
  packed = train_batch_lib.assemble(groups, packing=packing_lib.Packing(
      pack_len=32, row_multiple=FSDP), **KW)
  settings = CASES["clipped_ratio"]
  want_deltas, want = _train(settings, packed, tp=2)
  got_deltas, got = _train(
      dataclasses.replace(settings, scoring=dataclasses.replace(settings.scoring, attention=kernel)),
      packed, tp=2)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               got_deltas, want_deltas)


def test_learner_logprobs_of_packed_rows_equal_the_samplers_records():
  """Rollouts sampled by the engine at version 0, packed several to a row:
  the learner's log-probs of their completions equal the recorded ones."""
  from tests.sampler import engine_test  # the engine on the tiny model, as its tests run it
  setup = tiny.two_published_versions()
  v0, _ = setup["sampler_params"]
  groups = []
  engine = engine_test._engine(engine_test.ScriptedPublisher(v0, None, 0), setup, "in_flight",
                               lambda req, rs: groups.append(rs), max_async_level=1)
  engine_test._run_until(engine, lambda: len(groups) >= 4)
  rollouts = [r for rs in groups[:4] for r in rs]
  for i, r in enumerate(rollouts):  # assemble wants rewards and whole groups
    r.reward = float(i % 2)
  from arl_jax.core import rollout as rollout_lib
  batch_groups = [rollout_lib.Group(group_id=g, prompt_id=g, dispatch_version=0,
                                    rollouts=rollouts[4 * g:4 * g + 4]) for g in range(4)]
  packed = train_batch_lib.assemble(
      batch_groups, prompt_len=engine_test.PROMPT_LEN, max_new_tokens=engine_test.NEW,
      pad_id=engine_test.PAD, advantage_estimator="grpo",
      packing=packing_lib.Packing(pack_len=64))
  assert (packed.segment_ids.max(axis=1) > 1).any()
  logp, _ = logprobs_lib.token_logprobs_and_entropy(
      setup["graphdef"], setup["params"][0], packed.tokens, packed.segment_ids,
      packed.positions, 1.0)
  on = packed.loss_mask > 0
  assert on.sum() > 20
  np.testing.assert_allclose(np.asarray(logp)[on], packed.behaviour_logprobs[on], atol=1e-5)


def test_pack_len_reaches_the_learner_loop_through_the_config():
  from arl_jax.config import run_spec
  config = tiny.load_config()
  config.learner.pack_len = 64
  config.learner.num_minibatches = 2
  spec = run_spec.build(config)
  assert spec.packing == packing_lib.Packing(
      pack_len=64, num_slices=2, row_multiple=4,
      attention_width=packing_lib.attention_width(spec.model))
  config.learner.pack_len = -1
  with pytest.raises(run_spec.ConfigError, match="learner.pack_len"):
    run_spec.build(config)
  config.learner.pack_len = 0
  assert run_spec.build(config).packing is None

