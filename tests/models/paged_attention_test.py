"""JAX's Pallas paged attention kernels (`models/paged_attention.py`) on CPU:
the GPU kernel in interpret mode attends as the XLA path over gathered pages
and a paged engine's decode steps sample the same tokens through it; the TPU
ragged kernel's arguments give the XLA path's attention through the kernel's
own reference implementation and pass its shape checks, and its pool layout
samples the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as ragged_kernel

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


GEOMETRIES = [(4, 2, 4), (8, 1, 8), (2, 2, 6)]  # heads, KV heads, pages per row


def _pools_and_rows(heads, kv_heads, pages_per_row):
  """Random split pools, scaled queries, scattered page tables (the pages past
  a row's length are the trash page, 0) and lengths of 1, half, all columns."""
  rng = np.random.default_rng(0)
  b, dh, page_size, num_pages = 3, 16, 4, 64
  keys = jnp.asarray(rng.normal(size=(kv_heads, num_pages, page_size, dh)), jnp.float32)
  values = jnp.asarray(rng.normal(size=(kv_heads, num_pages, page_size, dh)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(b, heads, dh)) / np.sqrt(dh), jnp.float32)
  table = np.array([rng.permutation(np.arange(1, num_pages))[:pages_per_row] for _ in range(b)])
  lengths = np.array([1, page_size * pages_per_row // 2 + 1, page_size * pages_per_row])
  for row, n in enumerate(lengths):
    table[row, -(-n // page_size):] = 0
  return q, keys, values, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("heads,kv_heads,pages_per_row", GEOMETRIES)
def test_the_kernel_attends_as_the_xla_path(heads, kv_heads, pages_per_row):
  q, keys, values, table, lengths = _pools_and_rows(heads, kv_heads, pages_per_row)
  out = paged_attention.decode_attention(q, keys, values, table, lengths, interpret=True)
  np.testing.assert_allclose(out, _xla_attention(q, keys, values, table, lengths), atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,pages_per_row", GEOMETRIES)
def test_the_ragged_kernels_arguments_attend_as_the_xla_path(heads, kv_heads, pages_per_row):
  """What `ragged_decode_attention` hands TPU's kernel, given to the kernel's
  reference implementation (eager: it loops over the sequences), is the XLA
  path's attention; the kernel's own shape checks accept it."""
  q, keys, values, table, lengths = _pools_and_rows(heads, kv_heads, pages_per_row)
  # The interleaved pool: key of head h at 2h, value at 2h + 1.
  kv_pages = jnp.stack([keys, values], axis=1).transpose(2, 3, 0, 1, 4).reshape(
      keys.shape[1], keys.shape[2], 2 * kv_heads, keys.shape[3])
  args, kwargs = paged_attention.ragged_arguments(q, kv_pages, table, lengths)
  ragged_kernel.static_validate_inputs(*args, **kwargs)
  out = ragged_kernel.ref_ragged_paged_attention(*args, **kwargs)
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
  # (the XLA path over the TPU kernel's interleaved pool: the layout it reads)
  for attention, layout in (("xla", None), ("pallas_interpret", None), ("xla", "interleaved")):
    fns = slot_fns.make_sampler_fns(
        graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler, settings=settings,
        num_slots=slots, length=length, num_pages=slots * length // page_size + 1,
        page_size=page_size, paged_attention=attention, paged_layout=layout)
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
    states[attention, layout] = state
  reference = states["xla", None]
  for other in (states["pallas_interpret", None], states["xla", "interleaved"]):
    np.testing.assert_array_equal(other.tokens, reference.tokens)
    np.testing.assert_allclose(other.logprobs, reference.logprobs, atol=1e-5)


def test_the_kernels_are_refused_without_their_devices():
  config = tiny.load_config()
  config.sampler.kv_cache = "paged"
  config.sampler.paged_attention = "pallas"
  with pytest.raises(config_lib.ConfigError, match="sampler.paged_attention.*GPU kernel"):
    config_lib.resolve(config)
  config.sampler.paged_attention = "ragged"
  with pytest.raises(config_lib.ConfigError, match="sampler.paged_attention.*TPU kernel"):
    config_lib.resolve(config)
  # Planned devices have no platform to check; the model and the mesh are.
  with pytest.raises(config_lib.ConfigError, match="needs a head_dim that is a multiple of 128"):
    config_lib.resolve(config, devices=list(range(1)))
  config.model.head_dim = 128
  config_lib.resolve(config, devices=list(range(1)))
  with pytest.raises(config_lib.ConfigError, match="'ragged' runs on one sampler device for "
                     "now; the sampler mesh has 4"):
    config_lib.resolve(config, devices=list(range(8)))
  assert "cannot tile 3 KV heads" in paged_attention.ragged_geometry_problem(
      num_heads=6, num_kv_heads=3, head_dim=128, dtype="float32")
  assert "cannot tile 12 KV heads" in paged_attention.ragged_geometry_problem(
      num_heads=24, num_kv_heads=12, head_dim=128, dtype="bfloat16")
  assert paged_attention.ragged_geometry_problem(
      num_heads=16, num_kv_heads=2, head_dim=128, dtype="bfloat16") is None
  with pytest.raises(ValueError, match="'ragged' reads the 'interleaved' pool layout"):
    paged_kv_cache.PagedKVCache.zeros(batch=1, num_layers=1, num_kv_heads=1, length=8,
                                      head_dim=8, num_pages=4, page_size=4,
                                      attention="ragged", layout="split")
  config.sampler.kv_cache = "dense"
  with pytest.raises(config_lib.ConfigError, match="sampler.paged_attention.*needs kv_cache"):
    config_lib.resolve(config)


def test_the_ragged_kernel_builds_from_a_decode_steps_arguments():
  """Tracing TPU's kernel (no TPU needed until it compiles) with what a decode
  step hands it: 128-wide heads, GQA, pages of 16. (Block sizes are given: the
  kernel's tuned defaults ask the TPU's version.)"""
  b, heads, kv_heads, dh, pages = 8, 8, 2, 128, 32
  q = jax.ShapeDtypeStruct((b, heads, dh), jnp.bfloat16)
  kv_pages = jax.ShapeDtypeStruct((pages, 16, 2 * kv_heads, dh), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((b, 4), jnp.int32)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)

  def step(q, kv_pages, table, lengths):
    args, kwargs = paged_attention.ragged_arguments(q, kv_pages, table, lengths)
    return ragged_kernel.ragged_paged_attention(*args, **kwargs, num_kv_pages_per_block=4,
                                                num_queries_per_block=8)

  out = jax.eval_shape(step, q, kv_pages, table, lengths)
  assert out.shape == (b, heads, dh) and out.dtype == jnp.bfloat16
