"""Sampler log-probs, the sampling distribution, slot independence and compile counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl_jax.learner import publish as publish_lib
from arl_jax.sampler import sampling, token_draw
from arl_jax.testing import slots as slots_lib
from arl_jax.testing import tiny

PAD, EOS = 256, 258
SETTINGS = sampling.SamplingSettings(eos_id=EOS, pad_id=PAD, temperature=1.0)
BUCKET, NEW = 8, 12


def _published(meshes, sampler_shardings, params):
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  publisher.publish(params, 0)
  return publisher.latest()[1]


def _prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, int(rng.integers(1, BUCKET + 1))).tolist() for _ in range(n)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_learner_logprobs(temperature):
  """Same params, same tokens: behaviour log-probs == learner log-probs (<= 1e-5)."""
  cfg = tiny.tiny_model_config()
  meshes = tiny.role_meshes()
  assert not meshes.colocated  # learner on 4 devices, sampler on the other 4
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
  sampler_params = _published(meshes, sampler_shardings, params)
  settings = sampling.SamplingSettings(eos_id=EOS, pad_id=PAD, temperature=temperature)
  driver = slots_lib.SlotDriver(graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
                                settings=settings, num_slots=8, bucket=BUCKET,
                                max_new_tokens=NEW)
  driver.insert(sampler_params, 0, list(range(8)), _prompts(8), group_ids=list(range(8)))
  for _ in range(NEW - 1):
    driver.decode(sampler_params, 0)
  rows = [driver.row(i) for i in range(8)]
  tokens = np.stack([r["tokens"] for r in rows])
  mask = np.stack([r["token_mask"] for r in rows])
  # Tokens go to the learner through the host, as rollouts do.
  learner = slots_lib.teacher_forced_logprobs(graphdef, params, tokens, mask, temperature)
  sampled = np.stack([r["versions"] for r in rows]) >= 0
  assert sampled.sum() > 8 * 4
  behaviour = np.stack([r["logprobs"] for r in rows])
  assert np.abs(learner - behaviour)[sampled].max() <= 1e-5


def test_refilling_slots_never_changes_another_slots_tokens_or_logprobs():
  """Requests inserted at different times into a shared batch == each run alone."""
  cfg = tiny.tiny_model_config()
  meshes = tiny.single_device_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  prompts = _prompts(6, seed=3)
  make = lambda slots: slots_lib.SlotDriver(
      graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler, settings=SETTINGS,
      num_slots=slots, bucket=BUCKET, max_new_tokens=NEW)
  shared = make(4)
  # A schedule with refills: 0,1 start; 2 joins after 3 steps; 3 after 5; when
  # slot 0 is finished (after NEW steps), request 4 reuses it, and so on.
  shared.insert(params, 0, [0, 1], prompts[:2], group_ids=[0, 1])
  for step in range(3 * NEW):
    if step == 3:
      shared.insert(params, 0, [2], prompts[2:3], group_ids=[2])
    if step == 5:
      shared.insert(params, 0, [3], prompts[3:4], group_ids=[3])
    if step == NEW:
      first_two = [shared.row(0), shared.row(1)]
      shared.insert(params, 0, [0, 1], prompts[4:6], group_ids=[4, 5])
    shared.decode(params, 0)
  results = {0: first_two[0], 1: first_two[1], 2: shared.row(2), 3: shared.row(3),
             4: shared.row(0), 5: shared.row(1)}
  for i, prompt in enumerate(prompts):
    alone = make(1)
    alone.insert(params, 0, [0], [prompt], group_ids=[i])
    for _ in range(NEW - 1):
      alone.decode(params, 0)
    want, got = alone.row(0), results[i]
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    np.testing.assert_array_equal(got["versions"], want["versions"])
    np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-5)


def test_stop_tokens_apply_per_row():
  """One batch, two environments: a token ends the segment only of the rows
  whose stop set holds it (EOS ends every row)."""
  cfg = tiny.tiny_model_config()
  meshes = tiny.single_device_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  # Every token but EOS and PAD is a stop token for the rows that opt in.
  stops = tuple(i for i in range(cfg.vocab_size) if i not in (EOS, PAD))
  settings = sampling.SamplingSettings(eos_id=EOS, pad_id=PAD, stop_ids=stops)
  driver = slots_lib.SlotDriver(graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
                                settings=settings, num_slots=4, bucket=BUCKET, max_new_tokens=NEW)
  opt_in = np.array([True, False, True, False])
  stop_mask = np.repeat(opt_in[:, None], len(stops), axis=1)
  prompts = _prompts(4, seed=5)
  driver.insert(params, 0, [0, 1, 2, 3], prompts, group_ids=[0, 1, 2, 3], stop_mask=stop_mask)
  for _ in range(NEW - 1):
    driver.decode(params, 0)
  stopped = np.asarray(driver.state.stopped)
  for slot in range(4):
    row, start = driver.row(slot), len(prompts[slot])  # (the completion follows the prompt)
    completion = row["tokens"][start:][row["token_mask"][start:]]
    if opt_in[slot]:  # the first token (or EOS) ends the segment
      assert len(completion) == 1 and stopped[slot]
    else:  # only EOS or the budget ends it
      assert (len(completion) == NEW) or completion[-1] == EOS
      assert stopped[slot] == (completion[-1] == EOS)
      assert len(completion) > 1


def _two_versions_on_one_device(seed):
  """`(graphdef, params_v0, params_v1, driver)` with 4 slots on a single device."""
  cfg = tiny.tiny_model_config()
  meshes = tiny.single_device_meshes()
  graphdef, params_v0, _ = tiny.learner_and_sampler_params(cfg, meshes)
  params_v1 = tiny.perturb(params_v0, 0.05, seed=seed)
  driver = slots_lib.SlotDriver(graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
                                settings=SETTINGS, num_slots=4, bucket=BUCKET, max_new_tokens=NEW)
  return graphdef, params_v0, params_v1, driver


def test_pinned_versions_decode_each_slot_with_its_own_params():
  graphdef, params_v0, params_v1, driver = _two_versions_on_one_device(seed=1)
  prompts = _prompts(4, seed=5)
  driver.insert(params_v0, 0, [0, 1], prompts[:2], group_ids=[0, 1])
  driver.decode(params_v0, 0)
  driver.insert(params_v1, 1, [2, 3], prompts[2:], group_ids=[2, 3])
  pinned = np.array([0, 0, 1, 1])
  for _ in range(NEW):
    driver.decode(params_v0, 0, rows=pinned == 0)
    driver.decode(params_v1, 1, rows=pinned == 1)
  for slot, (params, version) in enumerate([(params_v0, 0)] * 2 + [(params_v1, 1)] * 2):
    row = driver.row(slot)
    sampled = row["versions"] >= 0
    assert sampled.sum() == NEW or row["tokens"][sampled][-1] == EOS
    assert np.all(row["versions"][sampled] == version)
    learner = slots_lib.teacher_forced_logprobs(graphdef, params, row["tokens"],
                                                row["token_mask"])[0]
    np.testing.assert_allclose(learner[sampled], row["logprobs"][sampled], atol=1e-5)


@pytest.mark.parametrize("recompute", [True, False])
def test_recompute_gives_logprobs_of_a_fresh_prefill_under_new_weights(recompute):
  graphdef, params_v0, params_v1, driver = _two_versions_on_one_device(seed=2)
  driver.insert(params_v0, 0, [0, 1, 2, 3], _prompts(4, seed=7), group_ids=[0, 1, 2, 3])
  for _ in range(3):
    driver.decode(params_v0, 0)
  if recompute:
    driver.recompute(params_v1)
  for _ in range(NEW - 4):
    driver.decode(params_v1, 1)
  worst = 0.0
  for slot in range(4):
    row = driver.row(slot)
    after = row["versions"] == 1
    assert after.any()
    # The tokens sampled before the swap keep their recorded v0 log-probs.
    assert np.all(row["versions"][(row["versions"] >= 0) & ~after] == 0)
    fresh = slots_lib.teacher_forced_logprobs(graphdef, params_v1, row["tokens"],
                                              row["token_mask"])[0]
    worst = max(worst, np.abs(fresh[after] - row["logprobs"][after]).max())
  if recompute:
    assert worst <= 1e-5
  else:  # `keep` attends to v0 keys/values: a real (measured) difference
    assert worst > 1e-4


def test_inverse_cdf_sampling_matches_softmax_distribution():
  logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]], jnp.float32)).repeat(4000, axis=0)
  keys = token_draw.row_keys(3, np.arange(4000), np.zeros(4000))
  tokens, logp, *_ = token_draw.sample_from_logits(logits, keys, jnp.int32(5), SETTINGS)
  freq = np.bincount(np.asarray(tokens), minlength=4) / 4000
  np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4], atol=0.03)
  np.testing.assert_allclose(np.exp(np.asarray(logp)), np.array([0.1, 0.2, 0.3, 0.4])[tokens],
                             rtol=1e-5)


@pytest.mark.parametrize("top_k, top_p, min_p, support, probs", [
    (2, 1.0, 0.0, [2, 3], [3 / 7, 4 / 7]),
    (0, 0.6, 0.0, [2, 3], [3 / 7, 4 / 7]),   # 0.4 < 0.6, 0.4 + 0.3 >= 0.6: keep {3, 2}
    (0, 0.3, 0.0, [3], [1.0]),               # the top token alone already reaches 0.3
    (3, 0.5, 0.0, [2, 3], [3 / 7, 4 / 7]),
    (0, 1.0, 0.6, [2, 3], [3 / 7, 4 / 7]),   # p >= 0.6 x 0.4 = 0.24: keep {3, 2}
    (0, 1.0, 0.8, [3], [1.0]),               # p >= 0.32: the top token alone
    (0, 1.0, 0.2, [0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4]),  # p >= 0.08: every token
    (2, 1.0, 0.6, [2, 3], [3 / 7, 4 / 7]),
])
def test_top_k_top_p_min_p_sample_and_record_the_truncated_distribution(top_k, top_p, min_p,
                                                                         support, probs):
  logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]], jnp.float32)).repeat(4000, axis=0)
  settings = sampling.SamplingSettings(eos_id=EOS, pad_id=PAD, top_k=top_k, top_p=top_p,
                                       min_p=min_p)
  keys = token_draw.row_keys(4, np.arange(4000), np.zeros(4000))
  tokens, logp, *_ = token_draw.sample_from_logits(logits, keys, jnp.int32(0), settings)
  tokens = np.asarray(tokens)
  assert set(np.unique(tokens)) == set(support)
  freq = np.array([np.mean(tokens == t) for t in support])
  np.testing.assert_allclose(freq, probs, atol=0.03)
  want = dict(zip(support, probs))
  np.testing.assert_allclose(np.exp(np.asarray(logp)), [want[t] for t in tokens], rtol=1e-5)


def test_greedy_takes_argmax():
  logits = jnp.array([[0.0, 3.0, 1.0], [5.0, -1.0, 0.0]], jnp.float32)
  settings = sampling.SamplingSettings(greedy=True, eos_id=EOS, pad_id=PAD)
  tokens, *_ = token_draw.sample_from_logits(logits, token_draw.row_keys(0, [0, 1], [0, 0]),
                                           jnp.int32(0), settings)
  np.testing.assert_array_equal(tokens, [1, 0])


def test_draws_depend_only_on_group_sample_and_column():
  logits = jnp.zeros((4, 50), jnp.float32)
  keys = token_draw.row_keys(0, [5, 6, 7, 8], [0, 1, 2, 3])
  a, *_ = token_draw.sample_from_logits(logits, keys, jnp.int32(3), SETTINGS)
  b, *_ = token_draw.sample_from_logits(logits[::-1], keys[::-1], jnp.int32(3), SETTINGS)
  np.testing.assert_array_equal(a, b[::-1])


def test_row_keys_are_pinned_and_the_jitted_insert_derives_the_same():
  # Golden keys of (seed 7; group, sample, turn), as the eager host derivation
  # gave them before the engine derived keys inside its insert program: a
  # change here changes every sampled token of every run.
  want = [[2737751932, 2099591257], [1400128608, 1700204917], [823905518, 2226571857]]
  ids = ([0, 5, 2**31 - 1], [0, 3, 1], [0, 0, 2])
  np.testing.assert_array_equal(token_draw.row_keys(7, *ids), want)
  in_program = jax.jit(token_draw.segment_keys)(jax.random.PRNGKey(7), token_draw.key_ids(*ids))
  np.testing.assert_array_equal(in_program, want)


def test_no_recompilation_across_steps_versions_and_prompt_lengths_in_a_bucket():
  cfg = tiny.tiny_model_config()
  meshes = tiny.role_meshes()
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  publisher.publish(params, 0)
  _, v0 = publisher.latest()
  publisher.publish(tiny.perturb(params, 0.01, seed=1), 1)
  _, v1 = publisher.latest()
  driver = slots_lib.SlotDriver(graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
                                settings=SETTINGS, num_slots=4, bucket=BUCKET, max_new_tokens=NEW)
  for wave in range(3):  # prompts of 1..8 tokens, all in the one bucket
    driver.insert(v0, 0, [0, 1, 2, 3], _prompts(4, seed=wave), group_ids=[0, 1, 2, 3])
    for step in range(6):
      params, version = (v0, 0) if step < 3 else (v1, 1)
      driver.decode(params, version, rows=np.array([True, True, step % 2 == 0, True]))
  assert driver.fns.traces()["insert"] == 1
  assert driver.fns.traces()["decode"] == 1


def test_bfloat16_sampler_mismatch_is_small_and_measured():
  """bf16 weights and KV cache, float32 log-softmax: the mismatch is real but small."""
  import dataclasses

  import jax

  cfg = tiny.tiny_model_config()
  meshes = tiny.role_meshes()
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings, dtype=jnp.bfloat16)
  publisher.publish(params, 0)
  _, bf16_params = publisher.latest()
  assert {x.dtype for x in jax.tree.leaves(bf16_params)} == {jnp.dtype(jnp.bfloat16)}
  driver = slots_lib.SlotDriver(
      graphdef=graphdef, model_cfg=dataclasses.replace(cfg, param_dtype="bfloat16"),
      mesh=meshes.sampler, settings=SETTINGS, num_slots=8, bucket=BUCKET, max_new_tokens=NEW)
  assert driver.state.cache.keys[0].dtype == jnp.bfloat16
  driver.insert(bf16_params, 0, list(range(8)), _prompts(8, seed=9), group_ids=list(range(8)))
  for _ in range(NEW - 1):
    driver.decode(bf16_params, 0)
  rows = [driver.row(i) for i in range(8)]
  tokens = np.stack([r["tokens"] for r in rows])
  mask = np.stack([r["token_mask"] for r in rows])
  sampled = np.stack([r["versions"] for r in rows]) >= 0
  learner = slots_lib.teacher_forced_logprobs(graphdef, params, tokens, mask)
  behaviour = np.stack([r["logprobs"] for r in rows])
  assert behaviour.dtype == np.float32
  mismatch = np.abs(learner - behaviour)[sampled]
  assert 1e-4 < mismatch.mean() < 0.1, mismatch.mean()
