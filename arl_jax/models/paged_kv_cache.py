"""A paged key/value cache: a pool of fixed-size pages per layer and a page
table per slot, so that memory follows the tokens slots hold, not `slots x L`.

Columns keep the meaning they have in the dense cache (`kv_cache.KVCache`):
column c of slot b lives at row `c % page_size` of page
`page_table[b, c // page_size]`. The host (`sampler/page_pool.py`) hands a slot
pages as it crosses page boundaries and takes them back when it leaves.
Table entries the host has not filled name page 0, the trash page: it is never
handed out, writes of masked rows go there, and no valid column lives there
(the `valid` mask keeps attention off it), so a slot's unused tail costs no
memory.

Attention reads the first `width` columns of every row by gathering the
first `width / page_size` pages of its table row: a decode step costs what
the batch's longest live context costs, not the slot length, but a program
is compiled per width (`engine_config.EngineConfig.decode_widths`; a
recompute reads them so). Decode steps and prefill chunks read their pages
a block at a time instead, as many blocks as their rows need
(`attend_blocks`, `paged_blocks.py`), so one program serves every width.

Two pool layouts per layer, the two kernels' (`paged_names.pool_layout`):
- "split": keys and values apart, `[KVH, pages, page_size, Dh]` each (the
  GPU kernel's); a gathered row is `[KVH, width/page_size, page_size, Dh]`,
  reshaped to the decoder's `[KVH, width, Dh]`.
- "interleaved": one pool `[pages, page_size, 2 * KVH, Dh]`, the key of KV
  head h at `2h` and its value at `2h + 1` (TPU's ragged paged attention
  kernel's); `values` is then empty.

Decode attention reads the gathered columns through the decoder's XLA
attention (`decode_kernels.XlaDecode`, either layout), or through a Pallas
kernel (`PallasDecode` on GPU, `RaggedDecode` on TPU: `decode_kernels.py`,
`models/paged_attention.py`), which
reads each row's first `index + 1` columns from its pages itself; rows start
at column 0 (`sampler/sampling.py`), so those are exactly the row's tokens.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from arl_jax.models import decode_kernels, paged_attention, paged_blocks, paged_names

TRASH_PAGE = paged_names.TRASH_PAGE


@flax.struct.dataclass
class PagedKVCache:
  """Per-layer page pools, the slots' page tables and their valid columns.

  Attributes:
    keys: one array per layer: "split" layout `[KVH, N, page_size, Dh]` (N
      pages, page 0 the trash page); "interleaved" `[N, page_size, 2 * KVH,
      Dh]`, keys and values.
    values: "split": likewise; "interleaved": empty.
    valid: `[B, L]` bool, True where a real (non-pad) token has been written.
    page_table: `[B, L / page_size]` int32, the page of each slot's column block.
    attention: static, how decode steps attend (a `decode_kernels` object).
    layout: static, "split" or "interleaved" (`paged_names.LAYOUTS`).
    mesh: static, the sampler mesh a kernel XLA cannot partition runs on per
      device ("ragged"; None: one device, or not needed).
  """

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  valid: jax.Array
  page_table: jax.Array
  attention: object = flax.struct.field(pytree_node=False, default=decode_kernels.XlaDecode())
  layout: str = flax.struct.field(pytree_node=False, default="split")
  mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def zeros(cls, *, batch: int, num_layers: int, num_kv_heads: int, length: int,
            head_dim: int, num_pages: int, page_size: int, dtype=jnp.float32,
            attention="xla", layout: str | None = None,
            mesh: Mesh | None = None) -> PagedKVCache:
    """`attention`: a kernel's name (`paged_names.ATTENTIONS`) or its
    `decode_kernels` object; `layout` None: the one it reads
    (`paged_names.pool_layout`)."""
    if length % page_size:
      raise ValueError(f"a paged cache's length ({length}) must be a multiple of its page "
                       f"size ({page_size})")
    attention = decode_kernels.named(attention)
    layout = paged_names.pool_layout(attention.name) if layout is None else layout
    paged_names.check_layout(attention.name, layout)
    if layout == "split":
      shape = (num_kv_heads, num_pages, page_size, head_dim)
      keys = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
      values = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    else:
      shape = (num_pages, page_size, 2 * num_kv_heads, head_dim)
      keys, values = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)), ()
    return cls(keys=keys, values=values, valid=jnp.zeros((batch, length), jnp.bool_),
               page_table=jnp.full((batch, length // page_size), TRASH_PAGE, jnp.int32),
               attention=attention, layout=layout, mesh=mesh)

  @property
  def page_size(self) -> int:
    return self.keys[0].shape[2 if self.layout == "split" else 1]

  @property
  def length(self) -> int:
    return self.valid.shape[1]

  def layer(self, i: int) -> PagedLayer:
    return PagedLayer(keys=self.keys[i],
                      values=self.values[i] if self.layout == "split" else None,
                      page_table=self.page_table, attention=self.attention,
                      layout=self.layout, mesh=self.mesh)

  def with_layers(self, layers) -> PagedKVCache:
    return self.replace(keys=tuple(layer.keys for layer in layers),
                        values=tuple(layer.values for layer in layers)
                        if self.layout == "split" else ())

  def write_prefill(self, slots: jax.Array, prefill) -> PagedKVCache:
    """Writes a prefill's dense cache (`[R, KVH, Pb, Dh]` per layer, every
    row from column 0) into columns `[0, Pb)` of slots `slots` `[R]`."""
    table = self.page_table[slots]
    r = slots.shape[0]
    index = jnp.zeros((r,), jnp.int32)
    if self.layout == "interleaved":
      return self.replace(keys=tuple(
          _scatter_interleaved(pool, table, k, v, index, None)
          for pool, k, v in zip(self.keys, prefill.keys, prefill.values)))
    keys = tuple(_scatter(pool, table, k, index, None) for pool, k in zip(self.keys,
                                                                           prefill.keys))
    values = tuple(_scatter(pool, table, v, index, None) for pool, v in zip(self.values,
                                                                             prefill.values))
    return self.replace(keys=keys, values=values)

  def fork_rows(self, src: jax.Array, dst: jax.Array, shared: jax.Array) -> PagedKVCache:
    """Rows `dst` `[R]` take the valid columns of rows `src` `[R]` before
    `shared` `[R]`, and the keys and values of the page holding column
    `shared - 1` (copied: the forked row writes there next). The pages
    before it are the same pages already: the host shared them
    (`PagePool.share`) and this cache's page table says so."""
    columns = jnp.arange(self.length)[None, :]
    block = (shared - 1) // self.page_size
    src_pages = jnp.take_along_axis(self.page_table[src], block[:, None], axis=1)[:, 0]
    dst_pages = jnp.take_along_axis(self.page_table[dst], block[:, None], axis=1)[:, 0]
    valid = self.valid.at[dst].set(self.valid[src] & (columns < shared[:, None]))
    if self.layout == "interleaved":  # pages on the first axis
      return self.replace(keys=tuple(kv.at[dst_pages].set(kv[src_pages]) for kv in self.keys),
                          valid=valid)
    return self.replace(
        keys=tuple(k.at[:, dst_pages].set(k[:, src_pages]) for k in self.keys),
        values=tuple(v.at[:, dst_pages].set(v[:, src_pages]) for v in self.values),
        valid=valid)

  def rows_view(self, rows: jax.Array, valid: jax.Array) -> PagedKVCache:
    """As `KVCache.rows_view`: the rows' page tables over the shared pool."""
    return self.replace(valid=valid, page_table=self.page_table[rows])

  def put_rows(self, rows: jax.Array, view: PagedKVCache, valid: jax.Array) -> PagedKVCache:
    """As `KVCache.put_rows`: the view wrote the pool itself."""
    del rows
    return self.replace(keys=view.keys, values=view.values, valid=valid)

  def logical_axes(self) -> PagedKVCache:
    """Each array's logical axis names (`rules.SAMPLER_RULES`): the pool's
    heads like the attention weights; pages are shared by every slot, so the
    pool is not split over the slots' `data` axis."""
    if self.layout == "split":
      layer = ("kv_heads", "kv_pages", "page_rows", "head_dim")
    else:  # (a tp shard of the 2 * KVH interleaved heads holds its heads' keys and values)
      layer = ("kv_pages", "page_rows", "kv_heads", "head_dim")
    return PagedKVCache(keys=tuple(layer for _ in self.keys),
                        values=tuple(layer for _ in self.values),
                        valid=("batch", "length"), page_table=("batch", "slot_pages"),
                        attention=self.attention, layout=self.layout, mesh=self.mesh)


def _write_places(table: jax.Array, index: jax.Array, t: int, page_size: int,
                  write_mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """The page and the row in it of columns `index[b] + t` of the rows whose
  page tables are `table` `[B, P]`, `[B, T]` each; masked rows: the trash page."""
  columns = index[:, None] + jnp.arange(t, dtype=index.dtype)[None, :]  # [B, T]
  pages = jnp.take_along_axis(table, columns // page_size, axis=1)
  if write_mask is not None:
    pages = jnp.where(write_mask[:, None], pages, TRASH_PAGE)
  return pages, columns % page_size


def _scatter(pool: jax.Array, table: jax.Array, new: jax.Array, index: jax.Array,
             write_mask: jax.Array | None) -> jax.Array:
  """Writes `new` `[B, KVH, T, Dh]` at columns `index[b] + t` of the rows
  whose page tables are `table` `[B, P]`; masked rows write the trash page."""
  pages, rows = _write_places(table, index, new.shape[2], pool.shape[2], write_mask)
  # Adjacent advanced indices on axes 1 and 2 stay in place: [KVH, B, T, Dh].
  return pool.at[:, pages, rows].set(new.transpose(1, 0, 2, 3))


def _scatter_interleaved(pool: jax.Array, table: jax.Array, k: jax.Array, v: jax.Array,
                         index: jax.Array, write_mask: jax.Array | None) -> jax.Array:
  """`_scatter` into an interleaved pool `[N, page_size, 2 * KVH, Dh]`: the
  keys `k` and values `v` `[B, KVH, T, Dh]` of head h at `2h` and `2h + 1`."""
  b, kvh, t, dh = k.shape
  pages, rows = _write_places(table, index, t, pool.shape[1], write_mask)
  kv = jnp.stack([k, v], axis=2).reshape(b, 2 * kvh, t, dh)  # k0, v0, k1, v1, ...
  return pool.at[pages, rows].set(kv.transpose(0, 2, 1, 3))


def gather_interleaved(pool: jax.Array, table: jax.Array,
                       width: int) -> tuple[jax.Array, jax.Array]:
  """`gather` from an interleaved pool: the keys and the values, `[B, KVH,
  width, Dh]` each."""
  page_size = pool.shape[1]
  if width % page_size:
    raise ValueError(f"a paged read's width ({width}) must be a multiple of the page size "
                     f"({page_size})")
  rows = pool[table[:, :width // page_size]]  # [B, W/ps, ps, 2*KVH, Dh]
  b, n, ps, heads, dh = rows.shape
  rows = rows.reshape(b, n * ps, heads // 2, 2, dh).transpose(3, 0, 2, 1, 4)
  return rows[0], rows[1]


def gather(pool: jax.Array, table: jax.Array, width: int) -> jax.Array:
  """The first `width` columns of every row, `[B, KVH, width, Dh]`, from the
  first `width / page_size` pages of each row of `table` `[B, P]`."""
  page_size = pool.shape[2]
  if width % page_size:
    raise ValueError(f"a paged read's width ({width}) must be a multiple of the page size "
                     f"({page_size})")
  rows = pool[:, table[:, :width // page_size]]  # [KVH, B, W/ps, ps, Dh]
  kvh, b, n, ps, dh = rows.shape
  return rows.transpose(1, 0, 2, 3, 4).reshape(b, kvh, n * ps, dh)


@flax.struct.dataclass
class PagedLayer:
  """One layer of a `PagedKVCache`, with the slots' page table."""

  keys: jax.Array
  values: jax.Array | None  # (None in the interleaved layout: `keys` holds both)
  page_table: jax.Array
  attention: object = flax.struct.field(pytree_node=False, default=decode_kernels.XlaDecode())
  layout: str = flax.struct.field(pytree_node=False, default="split")
  mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def attends(self) -> bool:
    """Whether decode attention runs in a kernel (`attend`), not in the decoder."""
    return self.attention.attends

  def write(self, k: jax.Array, v: jax.Array, index: jax.Array,
            write_mask: jax.Array | None) -> PagedLayer:
    """This layer with `k`, `v` `[B, KVH, T, Dh]` written at per-row offsets
    `index` `[B]` into the rows' pages (rows where `write_mask` is False
    write to the trash page)."""
    if self.layout == "interleaved":
      keys, values = _scatter_interleaved(self.keys, self.page_table, k, v, index,
                                          write_mask), None
    else:
      keys = _scatter(self.keys, self.page_table, k, index, write_mask)
      values = _scatter(self.values, self.page_table, v, index, write_mask)
    return self.replace(keys=keys, values=values)

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
             write_mask: jax.Array | None, width: int):
    """One decode step's attention through the paged attention kernel:
    writes `k`, `v` `[B, KVH, 1, Dh]` at columns `index` `[B]` and attends
    `q` `[B, H, Dh]` (already scaled) over each row's columns `[0, index]`
    among its first `width`. Returns `[B, H, Dh]` and the updated layer."""
    return self.attention.attend(self, q, k, v, index, write_mask, width)

  def attend_blocks(self, q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
                    write_mask: jax.Array | None, blocks: paged_blocks.Blocks):
    """XLA attention read a block of pages at a time (`paged_blocks.py`:
    one program for every context length): writes `k`, `v` `[B, KVH, T,
    Dh]` at per-row offsets `index` `[B]` and attends `q` `[B, T, H, Dh]`
    (already scaled) as `blocks` says. Returns `[B, T, H, Dh]` float32 and
    the updated layer."""
    new = self.write(k, v, index, write_mask)
    if self.layout == "interleaved":
      read = lambda pages: gather_interleaved(new.keys, pages, blocks.block)
    else:
      read = lambda pages: (gather(new.keys, pages, blocks.block),
                            gather(new.values, pages, blocks.block))
    return paged_blocks.attend(q, read, self.page_table, blocks), new

  def update(self, k: jax.Array, v: jax.Array, index: jax.Array,
             write_mask: jax.Array | None, width: int):
    """As `kv_cache.DenseLayer.update`: writes `k`, `v` `[B, KVH, T, Dh]` at
    per-row offsets `index` and returns the first `width` columns of every
    row (gathered from its pages) and the updated layer."""
    new = self.write(k, v, index, write_mask)
    if self.layout == "interleaved":
      return (*gather_interleaved(new.keys, self.page_table, width), new)
    return (gather(new.keys, self.page_table, width), gather(new.values, self.page_table, width),
            new)


def ragged_attend(pool: jax.Array, table: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                   index: jax.Array, write_mask: jax.Array | None, width: int,
                   mesh: Mesh | None) -> tuple[jax.Array, jax.Array]:
  """`PagedLayer.attend` through TPU's ragged kernel: writes `k`, `v` into the
  interleaved `pool` and attends `q` over each row's columns `[0, index]`.

  XLA cannot partition a Mosaic kernel, so on a sampler mesh of several
  devices it runs per device in a `shard_map`: rows over `data`, heads over
  `tp` (the interleaved pool's `2 * KVH` axis splits into whole key/value
  pairs). The pool is whole on every `data` shard, so each shard first writes
  every shard's new keys and values (all-gathered over `data`), which is what
  the XLA path's partitioned scatter does, then attends its own rows. An
  axis that does not divide its dimension stays whole (its shards compute the
  same values).
  """
  pages = width // pool.shape[1]
  mask = jnp.ones(index.shape, jnp.bool_) if write_mask is None else write_mask

  def local(pool, table, q, k, v, index, mask, rows_axis=None):
    written = (table, k, v, index, mask)
    if rows_axis is not None:
      written = tuple(jax.lax.all_gather(x, rows_axis, tiled=True) for x in written)
    pool = _scatter_interleaved(pool, *written)
    return paged_attention.ragged_decode_attention(q, pool, table[:, :pages], index + 1), pool

  if mesh is None or mesh.size == 1:
    return local(pool, table, q, k, v, index, mask)

  def axis(name, size):
    n = dict(mesh.shape).get(name, 1)
    return name if n > 1 and size % n == 0 else None

  rows_axis, heads_axis = axis("data", q.shape[0]), axis("tp", k.shape[1])
  rows, heads, pool_spec = P(rows_axis), P(rows_axis, heads_axis), P(None, None, heads_axis)
  return jax.shard_map(
      functools.partial(local, rows_axis=rows_axis), mesh=mesh,
      in_specs=(pool_spec, rows, heads, heads, heads, rows, rows),
      out_specs=(heads, pool_spec), check_vma=False)(pool, table, q, k, v, index, mask)
