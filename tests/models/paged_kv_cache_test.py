"""The paged KV cache: a decoder reading its pages gives the dense cache's
logits; masked rows write only the trash page."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arl_jax.models import decoder as decoder_lib
from arl_jax.models import kv_cache as kv_cache_lib
from arl_jax.models import paged_kv_cache
from arl_jax.testing import tiny

PAGE = 4


def _paged(table, num_pages=16, length=12, layout="split"):
  cache = paged_kv_cache.PagedKVCache.zeros(batch=3, num_layers=2, num_kv_heads=2,
                                            length=length, head_dim=8, num_pages=num_pages,
                                            page_size=PAGE, layout=layout)
  return cache.replace(page_table=jnp.asarray(table, jnp.int32))


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_prefill_and_decode_through_pages_equal_the_full_forward(layout):
  cfg = tiny.tiny_model_config()
  model = decoder_lib.Decoder(cfg, rngs=nnx.Rngs(0))
  tokens, mask = tiny.random_prompts(3, 12, 256, seed=4)
  mask[:, -6:] = True  # column 6 ends every prompt; the last 5 are decoded one at a time
  positions = decoder_lib.positions_from_mask(mask)
  logits_full, _ = model(tokens, positions, decoder_lib.causal_mask(mask))
  # Scattered pages; a row's first block is trash when it is all padding.
  table = np.array([[7, 3, 12], [0, 9, 1], [5, 14, 2]])
  table[:, 0] = np.where(mask[:, :PAGE].any(axis=1), table[:, 0], 0)
  p = 7
  valid = np.zeros((3, 12), bool)
  valid[:, :p] = mask[:, :p]
  prefill = kv_cache_lib.KVCache.zeros(batch=3, num_layers=2, num_kv_heads=2, length=p,
                                       head_dim=8)
  prefill = prefill.replace(valid=jnp.asarray(valid[:, :p]))
  logits, prefill = model(tokens[:, :p], positions[:, :p], decoder_lib.causal_mask(mask[:, :p]),
                          prefill, jnp.zeros(3, jnp.int32))
  np.testing.assert_allclose(logits[:, -1], logits_full[:, p - 1], atol=1e-5)
  slots = jnp.arange(3)
  cache = _paged(table, layout=layout).write_prefill(slots, prefill)
  for col in range(p, 12):
    valid[:, col] = True
    width = 8 if col < 8 else 12  # the pages that hold column `col`, as the engine picks
    index = jnp.full((3,), col, jnp.int32)
    attn = jnp.asarray(valid[:, None, :width]) & (jnp.arange(width)[None, None, :] <= col)
    logits, cache = model(tokens[:, col:col + 1], positions[:, col:col + 1], attn,
                          cache.replace(valid=jnp.asarray(valid)), index)
    np.testing.assert_allclose(logits[:, 0], logits_full[:, col], atol=1e-5)


@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_masked_rows_write_only_the_trash_page(layout):
  cache = _paged([[1, 2, 3], [4, 5, 6], [7, 8, 9]], layout=layout)
  layer = cache.layer(0)
  new = jnp.ones((3, 2, 2, 8))
  _, _, written = layer.update(new, new, jnp.array([3, 3, 3]), jnp.array([True, False, True]),
                               width=PAGE)
  keys = np.asarray(written.keys)
  by_page = np.moveaxis(keys, 1, 0) if layout == "split" else keys  # pages first
  touched = {int(p) for p in np.nonzero(by_page.reshape(16, -1).any(axis=1))[0]}
  # Columns 3-4 of rows 0 and 2: pages 1, 2 and 7, 8; row 1 went to page 0.
  assert touched == {0, 1, 2, 7, 8}


def test_a_read_width_must_be_whole_pages():
  with pytest.raises(ValueError, match="multiple of the page size"):
    paged_kv_cache.gather(jnp.zeros((4, 2, PAGE, 8)), jnp.zeros((3, 3), jnp.int32), 6)
  with pytest.raises(ValueError, match="multiple of its page size"):
    _paged([[0] * 3] * 3, length=10)


def test_the_interleaved_layout_holds_what_the_split_one_holds():
  """Prefill writes, decode writes, forks: TPU's kernel layout (keys and
  values interleaved per head) reads back the same columns as the split one."""
  rng = np.random.default_rng(3)
  table = np.array([[3, 5, 0], [7, 1, 2], [4, 6, 8]])
  prefill = kv_cache_lib.KVCache.zeros(batch=3, num_layers=2, num_kv_heads=2, length=6,
                                       head_dim=8)
  prefill = prefill.replace(
      keys=tuple(jnp.asarray(rng.normal(size=(3, 2, 6, 8)), jnp.float32) for _ in range(2)),
      values=tuple(jnp.asarray(rng.normal(size=(3, 2, 6, 8)), jnp.float32) for _ in range(2)))
  new_k, new_v = (jnp.asarray(rng.normal(size=(3, 2, 1, 8)), jnp.float32) for _ in range(2))
  read = {}
  for layout in ("split", "interleaved"):
    cache = _paged(table, layout=layout).write_prefill(jnp.arange(3), prefill)
    k, v, layer = cache.layer(1).update(new_k, new_v, jnp.array([6, 6, 6]),
                                        jnp.array([True, True, False]), width=3 * PAGE)
    cache = cache.with_layers([cache.layer(0), layer])
    # Row 2 forks row 1 sharing its first page; the page of column 5 is copied.
    cache = cache.replace(page_table=cache.page_table.at[2, 0].set(7))
    cache = cache.fork_rows(jnp.array([1]), jnp.array([2]), jnp.array([6]))
    forked = cache.layer(0).update(jnp.zeros((3, 2, 0, 8)), jnp.zeros((3, 2, 0, 8)),
                                   jnp.zeros(3, jnp.int32), None, width=3 * PAGE)
    read[layout] = (k, v, forked[0], forked[1], cache.valid)
  for split, interleaved in zip(read["split"], read["interleaved"]):
    np.testing.assert_array_equal(interleaved, split)
  k, _, forked_k, _, _ = read["split"]
  np.testing.assert_array_equal(forked_k[2, :, :6], forked_k[1, :, :6])  # (the fork happened)
  np.testing.assert_array_equal(k[1, :, 6], new_k[1, :, 0])  # (the decode write landed)


def test_both_caches_implement_the_cache_protocol_and_kernels_are_objects():
  """The decoder's view of a cache (`cache_protocol`), met by the dense and
  the paged cache alike; a paged cache holds its decode kernel as a strategy
  object (`decode_kernels`), named by the config's string."""
  from arl_jax.models import cache_protocol, decode_kernels, kv_cache
  dense = kv_cache.KVCache.zeros(batch=2, num_layers=1, num_kv_heads=1, length=8, head_dim=4)
  for attention in ("xla", "pallas_interpret", "ragged"):
    paged = paged_kv_cache.PagedKVCache.zeros(
        batch=2, num_layers=1, num_kv_heads=1, length=8, head_dim=4, num_pages=5, page_size=4,
        attention=attention)
    assert isinstance(paged, cache_protocol.DecodeCache)
    layer = paged.layer(0)
    assert isinstance(layer, cache_protocol.LayerCache)
    kernel = decode_kernels.named(attention)
    assert paged.attention is kernel and kernel.name == attention
    assert layer.attends is kernel.attends is (attention != "xla")
    assert isinstance(kernel, cache_protocol.KernelLayer) is False  # (a kernel is not a layer)
    assert paged.layout == (kernel.layout or "split")
  assert isinstance(dense, cache_protocol.DecodeCache)
  assert isinstance(dense.layer(0), cache_protocol.LayerCache) and not dense.layer(0).attends
  assert decode_kernels.named(decode_kernels.RaggedDecode()).needs_mesh
  with pytest.raises(ValueError, match="paged attention must be one of"):
    decode_kernels.named("flash")
