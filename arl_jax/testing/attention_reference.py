"""The plain XLA reference of decode attention over a paged KV pool, which
the Pallas kernels' tests and benchmark compare against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arl_jax.models import paged_kv_cache


def paged_decode_attention(q, keys, values, table, lengths):
  """Softmax attention of `q` `[B, H, Dh]` over each row's first `lengths`
  columns, gathered from its pages (`table` `[B, pages]` into the pools
  `keys`, `values` `[pages, KVH, page, Dh]`), heads grouped as the decoder
  groups them; scores and the weighted sum in float32, the result in `q`'s
  dtype."""
  width = table.shape[1] * keys.shape[2]
  k = paged_kv_cache.gather(keys, table, width)  # [B, KVH, W, Dh]
  v = paged_kv_cache.gather(values, table, width)
  b, h, dh = q.shape
  kvh = k.shape[1]
  qg = q.reshape(b, kvh, h // kvh, dh)
  scores = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32)
  live = jnp.arange(width)[None, None, None, :] < lengths[:, None, None, None]
  probs = jax.nn.softmax(jnp.where(live, scores, -1e30), axis=-1)
  out = jnp.einsum("bkgs,bksd->bkgd", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(b, h, dh).astype(q.dtype)
