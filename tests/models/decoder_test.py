"""The decoder: shapes, parameter count, KV cache equivalence, sharded init."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arl_jax.models import decoder as decoder_lib
from arl_jax.models import init_lib
from arl_jax.models import kv_cache as kv_cache_lib
from arl_jax.models import model_config as model_config_lib
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import tiny


@pytest.mark.parametrize("tie, value_head", [(True, False), (False, False), (True, True)])
def test_param_count_matches_config(tie, value_head):
  cfg = tiny.tiny_model_config(tie_embeddings=tie, value_head=value_head)
  _, abstract = init_lib.abstract_model(cfg)
  assert sum(x.size for x in jax.tree.leaves(abstract)) == cfg.num_params


def test_value_head_shares_the_trunk_and_starts_at_zero():
  cfg = tiny.tiny_model_config(value_head=True)
  model = decoder_lib.Decoder(cfg, rngs=nnx.Rngs(0))
  tokens, mask = tiny.random_prompts(3, 10, 256, seed=4)
  args = (tokens, decoder_lib.positions_from_mask(mask), decoder_lib.causal_mask(mask))
  logits, _, values = model(*args, with_values=True)
  assert values.shape == (3, 10) and values.dtype == jnp.float32
  np.testing.assert_array_equal(values, 0.0)  # zero-initialised head
  np.testing.assert_array_equal(model(*args)[0], logits)  # the policy is unchanged
  with pytest.raises(ValueError, match="value_head=True"):
    decoder_lib.Decoder(tiny.tiny_model_config(), rngs=nnx.Rngs(0))(*args, with_values=True)


def test_full_forward_equals_prefill_plus_cached_decode():
  cfg = tiny.tiny_model_config()
  model = decoder_lib.Decoder(cfg, rngs=nnx.Rngs(0))
  tokens, mask = tiny.random_prompts(3, 10, 256, seed=4)
  mask[:, -3:] = True  # the last 3 columns are "decoded" one at a time
  logits_full, _ = model(tokens, decoder_lib.positions_from_mask(mask),
                         decoder_lib.causal_mask(mask))
  cache = kv_cache_lib.KVCache.zeros(batch=3, num_layers=2, num_kv_heads=2, length=10,
                                     head_dim=8)
  p = 7
  cache = cache.replace(valid=kv_cache_lib.write_valid(cache.valid, jnp.asarray(mask[:, :p]),
                                                       jnp.zeros(3, jnp.int32)))
  positions = decoder_lib.positions_from_mask(mask)
  attn = cache.valid[:, None, :] & (jnp.arange(10)[None, None, :] <= jnp.arange(p)[None, :, None])
  logits, cache = model(tokens[:, :p], positions[:, :p], attn, cache, jnp.zeros(3, jnp.int32))
  np.testing.assert_allclose(logits[:, -1], logits_full[:, p - 1], atol=1e-5)
  for col in range(p, 10):
    index = jnp.full((3,), col, jnp.int32)
    cache = cache.replace(valid=kv_cache_lib.write_valid(cache.valid, jnp.ones((3, 1), bool),
                                                         index))
    attn = cache.valid[:, None, :] & (jnp.arange(10)[None, None, :] <= col)
    logits, cache = model(tokens[:, col:col + 1], positions[:, col:col + 1], attn, cache, index)
    np.testing.assert_allclose(logits[:, 0], logits_full[:, col], atol=1e-5)


def test_left_padding_does_not_change_logits():
  cfg = tiny.tiny_model_config()
  model = decoder_lib.Decoder(cfg, rngs=nnx.Rngs(1))
  ids = np.array([[5, 6, 7, 8]], np.int32)
  padded = np.array([[256, 256, 5, 6, 7, 8]], np.int32)
  mask = padded != 256
  a, _ = model(ids, decoder_lib.positions_from_mask(np.ones_like(ids, bool)),
               decoder_lib.causal_mask(np.ones_like(ids, bool)))
  b, _ = model(padded, decoder_lib.positions_from_mask(mask), decoder_lib.causal_mask(mask))
  np.testing.assert_allclose(a[0], b[0, 2:], atol=1e-5)


def test_params_are_created_sharded_per_the_learner_rules():
  meshes = tiny.role_meshes()
  cfg = tiny.tiny_model_config()
  _, params, shardings = init_lib.init_params(cfg, meshes.learner, rules_lib.LEARNER_RULES, 0)
  up = params["blocks"][0]["mlp"]["up"][...]
  assert up.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
  assert {s.data.shape for s in up.addressable_shards} == {(8, 64)}
  # The same seed gives the same values on one device: sharding never changes
  # the random draws (only XLA's fusion of the scale multiply, by 1 ulp).
  eager = nnx.split(decoder_lib.Decoder(cfg, rngs=nnx.Rngs(0)))[1]
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(eager)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_sharding_a_dimension_that_does_not_divide_names_the_parameter():
  meshes = tiny.role_meshes()
  cfg = tiny.tiny_model_config(d_model=30, head_dim=6)
  _, abstract = init_lib.abstract_model(cfg)
  with pytest.raises(ValueError, match=r"parameter \[.*of shape \(30, .*dimension 30 does not divide by mesh axis "
                                       r"'fsdp' of size 4"):
    rules_lib.state_shardings(abstract, meshes.learner, rules_lib.LEARNER_RULES)


def test_bad_model_config_is_rejected():
  with pytest.raises(ValueError, match="num_heads=3 must be a multiple"):
    model_config_lib.ModelConfig(vocab_size=10, d_model=8, num_layers=1, num_heads=3,
                                 num_kv_heads=2, head_dim=4, mlp_dim=8, max_seq_len=8)
