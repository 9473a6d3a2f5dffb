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

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from arl_jax.models import decode_kernels, page_writes, paged_blocks, paged_names

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
          page_writes.scatter_interleaved(pool, table, k, v, index, None)
          for pool, k, v in zip(self.keys, prefill.keys, prefill.values)))
    keys = tuple(page_writes.scatter(pool, table, k, index, None) for pool, k in zip(self.keys,
                                                                           prefill.keys))
    values = tuple(page_writes.scatter(pool, table, v, index, None) for pool, v in zip(self.values,
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
      keys, values = page_writes.scatter_interleaved(self.keys, self.page_table, k, v, index,
                                          write_mask), None
    else:
      keys = page_writes.scatter(self.keys, self.page_table, k, index, write_mask)
      values = page_writes.scatter(self.values, self.page_table, v, index, write_mask)
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
