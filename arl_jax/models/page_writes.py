"""Writing keys and values into a paged pool: where each new column goes
(`write_places`) and the scatter of the two pool layouts (`scatter`: "split",
keys and values in pools of their own, `[KVH, N, page_size, Dh]`;
`scatter_interleaved`: one pool `[N, page_size, 2 * KVH, Dh]`). The paged
cache (`paged_kv_cache.py`) and the decode kernels (`decode_kernels.py`)
both write with them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arl_jax.models.paged_names import TRASH_PAGE


def write_places(table: jax.Array, index: jax.Array, t: int, page_size: int,
                  write_mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """The page and the row in it of columns `index[b] + t` of the rows whose
  page tables are `table` `[B, P]`, `[B, T]` each; masked rows: the trash page."""
  columns = index[:, None] + jnp.arange(t, dtype=index.dtype)[None, :]  # [B, T]
  pages = jnp.take_along_axis(table, columns // page_size, axis=1)
  if write_mask is not None:
    pages = jnp.where(write_mask[:, None], pages, TRASH_PAGE)
  return pages, columns % page_size


def scatter(pool: jax.Array, table: jax.Array, new: jax.Array, index: jax.Array,
             write_mask: jax.Array | None) -> jax.Array:
  """Writes `new` `[B, KVH, T, Dh]` at columns `index[b] + t` of the rows
  whose page tables are `table` `[B, P]`; masked rows write the trash page."""
  pages, rows = write_places(table, index, new.shape[2], pool.shape[2], write_mask)
  # Adjacent advanced indices on axes 1 and 2 stay in place: [KVH, B, T, Dh].
  return pool.at[:, pages, rows].set(new.transpose(1, 0, 2, 3))


def scatter_interleaved(pool: jax.Array, table: jax.Array, k: jax.Array, v: jax.Array,
                         index: jax.Array, write_mask: jax.Array | None) -> jax.Array:
  """`scatter` into an interleaved pool `[N, page_size, 2 * KVH, Dh]`: the
  keys `k` and values `v` `[B, KVH, T, Dh]` of head h at `2h` and `2h + 1`."""
  b, kvh, t, dh = k.shape
  pages, rows = write_places(table, index, t, pool.shape[1], write_mask)
  kv = jnp.stack([k, v], axis=2).reshape(b, 2 * kvh, t, dh)  # k0, v0, k1, v1, ...
  return pool.at[pages, rows].set(kv.transpose(0, 2, 1, 3))
