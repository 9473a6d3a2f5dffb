"""Sampler log-probs, the sampling distribution and compile counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.learner import publish as publish_lib
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import sampling
from arl_jax.testing import tiny

PAD, EOS = 256, 258
SETTINGS = sampling.SamplingSettings(eos_id=EOS, pad_id=PAD, temperature=1.0)


def _generate(graphdef, params, tokens, mask, settings, max_new_tokens, version=0):
  b = tokens.shape[0]
  keys = sampling.row_keys(0, np.arange(b), np.zeros(b))
  state = jax.jit(sampling.prefill, static_argnums=0,
                  static_argnames=("settings", "max_new_tokens"))(
      graphdef, params, jnp.int32(version), tokens, mask, np.ones(b, bool), keys,
      settings=settings, max_new_tokens=max_new_tokens)
  decode = jax.jit(sampling.decode_step, static_argnums=0, static_argnames=("settings",))
  for _ in range(max_new_tokens - 1):
    state = decode(graphdef, params, jnp.int32(version), state, np.zeros(b, bool),
                   settings=settings)
  return state


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_learner_logprobs(temperature):
  """Same params, same tokens: behaviour log-probs == learner log-probs (<= 1e-5)."""
  cfg = tiny.tiny_model_config()
  meshes = tiny.role_meshes()
  assert not meshes.colocated  # learner on 4 devices, sampler on the other 4
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  publisher.publish(params, 0)
  _, sampler_params = publisher.latest()
  tokens, mask = tiny.random_prompts(8, 8, PAD)
  settings = sampling.SamplingSettings(eos_id=EOS, pad_id=PAD, temperature=temperature)
  state = _generate(graphdef, sampler_params, tokens, mask, settings, max_new_tokens=12)
  # Tokens go to the learner through the host, as rollouts do.
  learner_logp, _ = logprobs_lib.token_logprobs_and_entropy(
      graphdef, params, np.asarray(state.tokens), np.asarray(state.token_mask), temperature)
  sampled = np.asarray(state.versions) >= 0
  assert sampled.sum() > 8 * 4  # most rows sample several tokens before an EOS
  diff = np.abs(np.asarray(learner_logp) - np.asarray(state.logprobs))[sampled]
  assert diff.max() <= 1e-5, diff.max()


def test_decode_matches_full_forward_tokens_and_records_version():
  cfg = tiny.tiny_model_config()
  meshes = tiny.role_meshes("colocated")
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  tokens, mask = tiny.random_prompts(8, 6, PAD, seed=1)
  state = _generate(graphdef, params, tokens, mask, SETTINGS, max_new_tokens=5, version=7)
  versions = np.asarray(state.versions)
  token_mask = np.asarray(state.token_mask)
  assert np.all(versions[:, :6] == sampling.NO_VERSION)
  # Every sampled (real, non-prompt) token records version 7, nothing else does.
  np.testing.assert_array_equal(versions[:, 6:] == 7, token_mask[:, 6:])


def test_inverse_cdf_sampling_matches_softmax_distribution():
  logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]], jnp.float32)).repeat(4000, axis=0)
  keys = sampling.row_keys(3, np.arange(4000), np.zeros(4000))
  tokens, logp = sampling.sample_from_logits(logits, keys, jnp.int32(5), SETTINGS)
  freq = np.bincount(np.asarray(tokens), minlength=4) / 4000
  np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4], atol=0.03)
  np.testing.assert_allclose(np.exp(np.asarray(logp)), np.array([0.1, 0.2, 0.3, 0.4])[tokens],
                             rtol=1e-5)


def test_greedy_takes_argmax():
  logits = jnp.array([[0.0, 3.0, 1.0], [5.0, -1.0, 0.0]], jnp.float32)
  settings = sampling.SamplingSettings(greedy=True, eos_id=EOS, pad_id=PAD)
  tokens, _ = sampling.sample_from_logits(logits, sampling.row_keys(0, [0, 1], [0, 0]),
                                          jnp.int32(0), settings)
  np.testing.assert_array_equal(tokens, [1, 0])


def test_draws_depend_only_on_group_sample_and_column():
  logits = jnp.zeros((4, 50), jnp.float32)
  keys = sampling.row_keys(0, [5, 6, 7, 8], [0, 1, 2, 3])
  a, _ = sampling.sample_from_logits(logits, keys, jnp.int32(3), SETTINGS)
  b, _ = sampling.sample_from_logits(logits[::-1], keys[::-1], jnp.int32(3), SETTINGS)
  np.testing.assert_array_equal(a, b[::-1])


def test_decode_step_compiles_once_across_steps_and_versions():
  cfg = tiny.tiny_model_config()
  meshes = tiny.role_meshes()
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  publisher.publish(params, 0)
  publisher.publish(tiny.perturb(params, 0.01, seed=1), 1)
  _, params_v1 = publisher.latest()
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  publisher.publish(params, 0)
  _, params_v0 = publisher.latest()
  prefill_fn, decode_fn = engine_lib.make_sampler_fns(
      graphdef=graphdef, params_like=params_v0, mesh=meshes.sampler, settings=SETTINGS,
      num_slots=4, prompt_len=6, max_new_tokens=8)
  tokens, mask = tiny.random_prompts(4, 6, PAD)
  for wave in range(2):
    keys = sampling.row_keys(wave, np.arange(4), np.zeros(4))
    state = prefill_fn(params_v0, jnp.int32(0), tokens, mask, np.ones(4, bool), keys)
    for step in range(6):  # swapping params and version mid-wave must not recompile
      p, v = (params_v0, 0) if step < 3 else (params_v1, 1)
      state = decode_fn(p, jnp.int32(v), state, np.zeros(4, bool))
  assert prefill_fn._cache_size() == 1  # noqa: SLF001
  assert decode_fn._cache_size() == 1  # noqa: SLF001
  # Columns 6..9 were sampled under version 0 (prefill + 3 steps), 10..13 under 1.
  versions = np.asarray(state.versions)[:, 6:]
  live = np.asarray(state.token_mask)[:, 6:]
  expected = np.where(np.arange(8) < 4, 0, 1)[None, :].repeat(4, axis=0)
  np.testing.assert_array_equal(np.where(live, versions, -1), np.where(live, expected, -1))
