"""Chunked vocabulary scoring (`learner.logprob_chunk`): the log-probs,
entropy, values and their gradients of `chunk` tokens at a time equal the
whole computation's, and the compiled step's scratch memory stops growing
with tokens x vocabulary."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arl_jax.config import run_spec
from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.learner import loss_settings
from arl_jax.models import decoder as decoder_lib
from arl_jax.testing import tiny
from tests.learner.update_test import _host, _mesh, _random_batch, _state_and_update

PAD = 256


def _model(**overrides):
  cfg = tiny.tiny_model_config(**overrides)
  graphdef, params = nnx.split(decoder_lib.Decoder(cfg, rngs=nnx.Rngs(0)))
  return cfg, graphdef, params


def _segments(mask):
  """One sequence per row: `(segment_ids, positions)` of a token mask."""
  return mask.astype(jnp.int32), decoder_lib.positions_from_mask(mask)


def _rows(rows=3, length=10, seed=0):
  tokens, mask = tiny.random_prompts(rows, length, PAD, seed=seed)
  return jnp.asarray(tokens), jnp.asarray(mask)


@pytest.mark.parametrize("chunk", [7, 16, 64])
@pytest.mark.parametrize("value_head", [False, True])
def test_chunked_scores_and_gradients_equal_the_whole_computation(chunk, value_head):
  """Chunks that divide the tokens or not (27 scored tokens), or hold them all."""
  _, graphdef, params = _model(value_head=value_head)
  tokens, mask = _rows()

  def objective(params, chunk):
    out = logprobs_lib.token_logprobs_and_entropy(graphdef, params, tokens, *_segments(mask), 0.7,
                                                  with_values=value_head, chunk=chunk)
    weights = mask.astype(jnp.float32)
    return sum(jnp.sum(x * weights * (i + 1)) for i, x in enumerate(out)), out

  (whole, whole_out), whole_grads = jax.value_and_grad(objective, has_aux=True)(params, 0)
  (part, part_out), part_grads = jax.value_and_grad(objective, has_aux=True)(params, chunk)
  for a, b in zip(whole_out, part_out):
    np.testing.assert_allclose(b, a, atol=1e-5)
  np.testing.assert_allclose(part, whole, rtol=1e-5)
  # Gradients sum over every token in another order: float32 rounding, relative.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5), whole_grads,
               part_grads)


def _scratch_bytes(vocab_size, chunk, tokens=1024):
  """Temporary bytes XLA plans for the gradient of the log-probs' sum over
  one row of `tokens` tokens."""
  _, graphdef, params = _model(vocab_size=vocab_size)
  tokens_, mask = _rows(rows=1, length=tokens)

  def objective(params):
    logp, entropy = logprobs_lib.token_logprobs_and_entropy(graphdef, params, tokens_, *_segments(mask),
                                                            1.0,
                                                            chunk=chunk)
    return jnp.sum(logp) + jnp.sum(entropy)

  compiled = jax.jit(jax.grad(objective)).lower(params).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_scoring_memory_does_not_grow_with_tokens_times_vocabulary():
  whole = {v: _scratch_bytes(v, 0) for v in (4096, 16384)}
  chunked = {v: _scratch_bytes(v, 128) for v in (4096, 16384)}
  # From a 4k to a 16k vocabulary the whole computation's scratch grows by
  # several [1024, 12288] float32 arrays (48 MiB each: logits, their
  # log-softmax, gradients); the chunked one's by a few [128, 12288] ones.
  # (What stays is the row's attention, [1024, 1024] per head and layer.)
  grown = lambda sizes: sizes[16384] - sizes[4096]
  assert grown(whole) > 2 * 1024 * 12288 * 4
  assert grown(chunked) < grown(whole) / 5
  assert chunked[16384] < whole[16384] / 2


def test_a_train_step_with_chunked_scoring_equals_the_whole_one():
  mesh = _mesh((("fsdp", 2), ("tp", 1)))
  batch = _random_batch(np.random.default_rng(3))
  results = []
  # The second step also scans over the layers (same numbers: `Decoder`).
  for chunk in (0, 5):
    settings = loss_settings.LossSettings.of(logprob_chunk=chunk, scan_layers=chunk > 0)
    _, state, update_fn = _state_and_update(settings, mesh)
    state, metrics = update_fn(state, batch)
    results.append((_host(state.params), {k: float(v) for k, v in metrics.items()}))
  (p0, m0), (p5, m5) = results
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6), p0, p5)
  for key in ("loss", "entropy", "ratio_mean", "grad_norm"):
    np.testing.assert_allclose(m5[key], m0[key], rtol=1e-4, err_msg=key)


def test_a_negative_chunk_is_a_config_error():
  config = tiny.load_config()
  config.learner.logprob_chunk = -1
  with pytest.raises(run_spec.ConfigError, match="learner.logprob_chunk"):
    run_spec.resolve(config)
