"""JAX's Pallas paged attention kernels (`models/paged_attention.py`) on CPU:
the GPU kernel in interpret mode attends as the XLA path over gathered pages
and a paged engine's decode steps sample the same tokens through it; the TPU
ragged kernel's arguments give the XLA path's attention through the kernel's
own reference implementation and pass its shape checks, and its pool layout
samples the same tokens. The XLA path read a block of pages at a time
(`models/paged_blocks.py`) attends and samples as over the whole width."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as ragged_kernel

from arl_jax.config import run_spec
from arl_jax.core import rows as rows_lib
from arl_jax.models import paged_attention, paged_blocks, paged_kv_cache
from arl_jax.sampler import sampling, slot_fns, token_draw
from arl_jax.sharding import mesh_lib
from arl_jax.testing import attention_reference, tiny

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
  want = attention_reference.paged_decode_attention(q, keys, values, table, lengths)
  np.testing.assert_allclose(out, want, atol=1e-5)


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
  want = attention_reference.paged_decode_attention(q, keys, values, table, lengths)
  np.testing.assert_allclose(out, want, atol=1e-5)


def _decode(meshes, attention, layout=None, orders=((0, 1, 2, 3),), steps=12, vocab_size=259,
            budgets=(16, 16, 16, 16), block=0):
  """Slot functions of a paged cache decoding 4 rows (contexts of 3-12 tokens
  from column 0) for `steps` steps, the rows handed to each call in the next
  of `orders` (a row lands on another `data` shard when its place changes);
  attention over every column at once, or (`block`) a block of columns at a
  time, as many blocks as the longest context needs."""
  cfg = tiny.tiny_model_config(vocab_size=vocab_size)
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
  params = jax.device_put(params, sampler_shardings)
  slots, length, page_size, bucket = 4, 32, 4, 12
  settings = sampling.SamplingSettings(eos_id=10 ** 6, pad_id=256)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 5, 12)]
  tokens, mask = rows_lib.left_pad(prompts, bucket, 256)
  fns = slot_fns.make_sampler_fns(
      graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler, settings=settings,
      num_slots=slots, length=length, num_pages=slots * length // page_size + 1,
      page_size=page_size, paged_attention=attention, paged_layout=layout)
  state = fns.set_pages(fns.init(), np.arange(1, slots * length // page_size + 1,
                                              dtype=np.int32).reshape(slots, -1))
  rows = np.arange(slots, dtype=np.int32)
  state = fns.insert_from_ids(
      params, jnp.int32(0), state, np.asarray(jax.random.PRNGKey(0)), rows, tokens, mask,
      token_draw.key_ids(rows, np.zeros(slots)), np.asarray(budgets, np.int32),
      np.ones((slots, 0), bool), np.zeros(slots, np.int32),
      np.zeros((slots, bucket), np.float32), np.full((slots, bucket), -1, np.int32))
  for step in range(steps):
    order = np.asarray(orders[step % len(orders)], np.int32)
    if block:
      blocks = np.int32(int(jnp.max(state.index)) // block + 1)
      state = fns.decode_rows(params, jnp.int32(0), state, np.zeros(slots, bool), order,
                              blocks, width=None, block=block)
    else:
      state = fns.decode_rows(params, jnp.int32(0), state, np.zeros(slots, bool), order,
                              width=length)
  return state


def _assert_same_samples(state, reference):
  np.testing.assert_array_equal(state.tokens, reference.tokens)
  np.testing.assert_allclose(state.logprobs, reference.logprobs, atol=1e-5)


def test_decode_steps_through_the_kernel_sample_what_the_xla_path_samples():
  """The GPU kernel's tokens and log-probs are the XLA path's (it reads the
  first `index + 1` columns of each row), and so are the XLA path's over the
  TPU kernel's interleaved pool."""
  meshes = tiny.single_device_meshes()
  reference = _decode(meshes, "xla")
  _assert_same_samples(_decode(meshes, "pallas_interpret"), reference)
  _assert_same_samples(_decode(meshes, "xla", "interleaved"), reference)


@pytest.mark.parametrize("heads,kv_heads,pages_per_row", GEOMETRIES)
@pytest.mark.parametrize("block_pages", [1, 2, 3])
def test_attention_read_in_blocks_is_the_whole_widths(heads, kv_heads, pages_per_row,
                                                      block_pages):
  """`paged_blocks.attend` (an online softmax over blocks of pages) gives the
  softmax over every column: blocks of 1 page, of 2, of 3 (which do not
  divide every row, so the last block reads past the table: padded), read
  as many as the longest row needs, or more (the rest masked)."""
  q, keys, values, table, lengths = _pools_and_rows(heads, kv_heads, pages_per_row)
  reference = attention_reference.paged_decode_attention(q, keys, values, table, lengths)
  block = block_pages * keys.shape[2]
  read = lambda pages: (paged_kv_cache.gather(keys, pages, block),
                        paged_kv_cache.gather(values, pages, block))
  width = table.shape[1] * keys.shape[2]
  valid = jnp.arange(width)[None, :] < lengths[:, None]
  needed = -(-int(lengths.max()) // block)
  for count in (needed, needed + 1):
    blocks = paged_blocks.Blocks(valid=valid, columns=(lengths - 1)[:, None],
                                 count=jnp.int32(count), block=block)
    out = jax.jit(paged_blocks.attend, static_argnums=1)(q[:, None], read, table, blocks)
    np.testing.assert_allclose(out[:, 0], reference, atol=1e-5)


def test_decode_steps_reading_blocks_sample_what_the_whole_width_samples():
  """A paged decode step's attention read a block of pages at a time
  (`width=None`) samples the tokens of one over the whole width, with either
  pool layout, blocks that do not divide the slot (12 of 32 columns), and
  on a sampler mesh of 2 data x 2 tp devices with rows changing shards."""
  meshes = tiny.single_device_meshes()
  reference = _decode(meshes, "xla")
  _assert_same_samples(_decode(meshes, "xla", block=8), reference)
  _assert_same_samples(_decode(meshes, "xla", "interleaved", block=4), reference)
  _assert_same_samples(_decode(meshes, "xla", block=12), reference)
  orders = ((0, 1, 2, 3), (2, 3, 0, 1), (3, 1, 0, 0))
  run = dict(orders=orders, vocab_size=260, budgets=(16, 16, 4, 16))
  sharded = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(
      placement="disaggregated", sampler=(("data", 2), ("tp", 2))))
  _assert_same_samples(_decode(sharded, "xla", block=8, **run), _decode(meshes, "xla", **run))


_STAND_IN_SHAPES = []


def _ragged_stand_in(q, kv_pages, table, lengths):
  """What TPU's ragged kernel computes for a decode step (its reference,
  `ref_ragged_paged_attention`, loops in Python and cannot run under jit)."""
  _STAND_IN_SHAPES.append((q.shape, kv_pages.shape))
  width = table.shape[1] * kv_pages.shape[1]
  k, v = paged_kv_cache.gather_interleaved(kv_pages, table, width)
  b, h, dh = q.shape
  qg = q.reshape(b, k.shape[1], h // k.shape[1], dh)
  scores = jnp.einsum("bkgd,bksd->bkgs", qg, k)
  scores = jnp.where(jnp.arange(width)[None, None, None, :] < lengths[:, None, None, None],
                     scores, -1e30)
  return jnp.einsum("bkgs,bksd->bkgd", jax.nn.softmax(scores, axis=-1), v).reshape(b, h, dh)


def test_the_ragged_path_per_device_on_a_sampler_mesh(monkeypatch):
  """`"ragged"` on a sampler mesh of 2 data x 2 tp devices runs the kernel per
  device in a shard_map; with a stand-in for the kernel (it cannot run off a
  TPU), the samples are the XLA path's on one device, also when the rows
  change shards between calls (each shard writes every shard's new keys and
  values into its whole copy of the pool), a row is handed twice and a row
  has ended (its writes masked to the trash page)."""
  monkeypatch.setattr(paged_attention, "ragged_decode_attention", _ragged_stand_in)
  orders = ((0, 1, 2, 3), (2, 3, 0, 1), (3, 1, 0, 0))
  # (a vocabulary that tp = 2 divides; row 2 ends after 4 tokens)
  run = dict(orders=orders, vocab_size=260, budgets=(16, 16, 4, 16))
  reference = _decode(tiny.single_device_meshes(), "xla", **run)
  meshes = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(
      placement="disaggregated", sampler=(("data", 2), ("tp", 2))))
  assert dict(meshes.sampler.shape) == {"data": 2, "tp": 2}
  _STAND_IN_SHAPES.clear()
  state = _decode(meshes, "ragged", **run)
  _assert_same_samples(state, reference)
  assert bool(state.done[2]) and not bool(state.done[0])  # (row 2 did end, early)
  # Per device: 2 of the 4 rows, 2 of the 4 query heads, 1 of the 2 KV heads' pairs.
  assert _STAND_IN_SHAPES and all(q == (2, 2, 8) and kv[2] == 2 for q, kv in _STAND_IN_SHAPES)


def test_the_kernels_are_refused_without_their_devices():
  config = tiny.load_config()
  config.sampler.kv_cache = "paged"
  config.sampler.paged_attention = "pallas"
  with pytest.raises(run_spec.ConfigError, match="sampler.paged_attention.*GPU kernel"):
    run_spec.resolve(config)
  config.sampler.paged_attention = "ragged"
  with pytest.raises(run_spec.ConfigError, match="sampler.paged_attention.*TPU kernel"):
    run_spec.resolve(config)
  # Planned devices have no platform to check; the model and the mesh are.
  with pytest.raises(run_spec.ConfigError, match="needs a head_dim that is a multiple of 128"):
    run_spec.resolve(config, devices=list(range(1)))
  config.model.head_dim = 128
  run_spec.resolve(config, devices=list(range(8)))  # (per device on a sampler mesh)
  # The kernel tiles each device's heads: 12 KV heads do, a tp = 2 shard's 6 do not.
  config.model.update(num_heads=24, num_kv_heads=12)
  run_spec.resolve(config, devices=list(range(8)))
  config.mesh.sampler = (("data", -1), ("tp", 2))
  with pytest.raises(run_spec.ConfigError, match="cannot tile 6 KV heads in float32"):
    run_spec.resolve(config, devices=list(range(8)))
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
  with pytest.raises(run_spec.ConfigError, match="sampler.paged_attention.*needs kv_cache"):
    run_spec.resolve(config)


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
