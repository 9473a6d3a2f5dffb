"""JAX's Pallas paged attention kernel (`models/paged_attention.py`), run in
interpret mode on CPU: the same attention as the XLA path over gathered
pages, and a paged engine's decode steps sample the same tokens through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl_jax import config_lib
from arl_jax import rows as rows_lib
from arl_jax.models import paged_attention, paged_kv_cache
from arl_jax.sampler import sampling, slot_fns, token_draw
from arl_jax.testing import tiny


def _xla_attention(q, keys, values, table, lengths):
  """Softmax attention of `q` `[B, H, Dh]` over each row's first `lengths`
  columns, gathered from its pages (the decoder's grouping of heads)."""
  width = table.shape[1] * keys.shape[2]
  k = paged_kv_cache.gather(keys, table, width)  # [B, KVH, W, Dh]
  v = paged_kv_cache.gather(values, table, width)
  b, h, dh = q.shape
  kvh = k.shape[1]
  qg = q.reshape(b, kvh, h // kvh, dh)
  scores = jnp.einsum("bkgd,bksd->bkgs", qg, k)
  scores = jnp.where(jnp.arange(width)[None, None, None, :] < lengths[:, None, None, None],
                     scores, -1e30)
  out = jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(scores, axis=-1), v)
  return out.reshape(b, h, dh)


@pytest.mark.parametrize("heads,kv_heads,pages_per_row", [(4, 2, 4), (8, 1, 8), (2, 2, 6)])
def test_the_kernel_attends_as_the_xla_path(heads, kv_heads, pages_per_row):
  rng = np.random.default_rng(0)
  b, dh, page_size, num_pages = 3, 16, 4, 64
  keys = jnp.asarray(rng.normal(size=(kv_heads, num_pages, page_size, dh)), jnp.float32)
  values = jnp.asarray(rng.normal(size=(kv_heads, num_pages, page_size, dh)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(b, heads, dh)) / np.sqrt(dh), jnp.float32)
  # Scattered pages; the pages past a row's length are the trash page (0).
  table = np.array([rng.permutation(np.arange(1, num_pages))[:pages_per_row] for _ in range(b)])
  lengths = np.array([1, page_size * pages_per_row // 2 + 1, page_size * pages_per_row])
  for row, n in enumerate(lengths):
    table[row, -(-n // page_size):] = 0
  table, lengths = jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)
  out = paged_attention.decode_attention(q, keys, values, table, lengths, interpret=True)
  np.testing.assert_allclose(out, _xla_attention(q, keys, values, table, lengths), atol=1e-5)


def test_decode_steps_through_the_kernel_sample_what_the_xla_path_samples():
  """Slot functions of a paged cache decoding 4 rows (contexts of 3-9 tokens
  from column 0) for 12 steps: the kernel's tokens and log-probs are the
  XLA path's (the kernel reads the first `index + 1` columns of each row)."""
  cfg = tiny.tiny_model_config()
  meshes = tiny.single_device_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  slots, length, page_size, bucket = 4, 32, 4, 12
  settings = sampling.SamplingSettings(eos_id=10 ** 6, pad_id=256)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 5, 12)]
  tokens, mask = rows_lib.left_pad(prompts, bucket, 256)
  states = {}
  for attention in ("xla", "pallas_interpret"):
    fns = slot_fns.make_sampler_fns(
        graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler, settings=settings,
        num_slots=slots, length=length, num_pages=slots * length // page_size + 1,
        page_size=page_size, paged_attention=attention)
    state = fns.set_pages(fns.init(), np.arange(1, slots * length // page_size + 1,
                                                dtype=np.int32).reshape(slots, -1))
    rows = np.arange(slots, dtype=np.int32)
    state = fns.insert_from_ids(
        params, jnp.int32(0), state, np.asarray(jax.random.PRNGKey(0)), rows, tokens, mask,
        token_draw.key_ids(rows, np.zeros(slots)), np.full(slots, 16, np.int32),
        np.ones((slots, 0), bool), np.zeros(slots, np.int32),
        np.zeros((slots, bucket), np.float32), np.full((slots, bucket), -1, np.int32))
    for _ in range(12):
      state = fns.decode_rows(params, jnp.int32(0), state, np.zeros(slots, bool), rows,
                              width=length)
    states[attention] = state
  np.testing.assert_array_equal(states["pallas_interpret"].tokens, states["xla"].tokens)
  np.testing.assert_allclose(states["pallas_interpret"].logprobs, states["xla"].logprobs,
                             atol=1e-5)


def test_the_gpu_kernel_is_refused_without_a_gpu():
  config = tiny.load_config()
  config.sampler.kv_cache = "paged"
  config.sampler.paged_attention = "pallas"
  with pytest.raises(config_lib.ConfigError, match="sampler.paged_attention.*GPU kernel"):
    config_lib.resolve(config)
  config.sampler.kv_cache = "dense"
  with pytest.raises(config_lib.ConfigError, match="sampler.paged_attention.*needs kv_cache"):
    config_lib.resolve(config)
