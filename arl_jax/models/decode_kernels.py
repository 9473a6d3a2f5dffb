"""How a paged cache's decode steps attend: one small strategy object per
kernel, held by the cache (static: part of the compiled program's identity).

- `XlaDecode`: the decoder's own XLA attention over the gathered columns (or
  a block of pages at a time, `paged_blocks.py`); reads either pool layout.
- `PallasDecode`: JAX's Pallas paged attention kernel (GPU; `interpret=True`
  runs it anywhere, slowly), over the "split" layout.
- `RaggedDecode`: TPU's ragged paged attention kernel over the "interleaved"
  layout, per device in a `shard_map` on a sampler mesh.

A config names one (`sampler.paged_attention`: `paged_names.ATTENTIONS`, the
JAX-free list host code reads); `named` gives its object. The layer asks it
`attends` (does the kernel attend, or the decoder?) and hands it the decode
step (`attend`). Before issue 53 the cache carried the name and compared
strings in three places.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from arl_jax.models import page_writes, paged_attention, paged_names


@dataclasses.dataclass(frozen=True)
class XlaDecode:
  """The decoder attends over the gathered columns: no kernel of its own."""

  name: ClassVar[str] = "xla"
  layout: ClassVar[str | None] = None  # (either)
  attends: ClassVar[bool] = False
  needs_mesh: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class PallasDecode:
  """JAX's Pallas paged attention kernel (GPU; `interpret` anywhere)."""

  interpret: bool = False
  layout: ClassVar[str] = "split"
  attends: ClassVar[bool] = True
  needs_mesh: ClassVar[bool] = False

  @property
  def name(self) -> str:
    return "pallas_interpret" if self.interpret else "pallas"

  def attend(self, layer, q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
             write_mask: jax.Array | None, width: int):
    """`(out [B, H, Dh], layer)`: writes this step's keys and values into the
    pages, then the kernel reads each row's own pages."""
    new = layer.write(k, v, index, write_mask)
    out = paged_attention.decode_attention(
        q, new.keys, new.values, layer.page_table[:, :width // new.keys.shape[2]], index + 1,
        interpret=self.interpret)
    return out, new


@dataclasses.dataclass(frozen=True)
class RaggedDecode:
  """TPU's ragged paged attention kernel, per device on a sampler mesh."""

  name: ClassVar[str] = "ragged"
  layout: ClassVar[str] = "interleaved"
  attends: ClassVar[bool] = True
  needs_mesh: ClassVar[bool] = True  # (XLA cannot partition a Mosaic kernel)

  def attend(self, layer, q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
             write_mask: jax.Array | None, width: int):
    out, keys = _ragged_attend(layer.keys, layer.page_table, q, k, v, index, write_mask, width,
                               layer.mesh)
    return out, layer.replace(keys=keys)


def _ragged_attend(pool: jax.Array, table: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
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
    pool = page_writes.scatter_interleaved(pool, *written)
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


_KERNELS = (XlaDecode(), PallasDecode(), PallasDecode(interpret=True), RaggedDecode())
KERNELS = {kernel.name: kernel for kernel in _KERNELS}
assert tuple(KERNELS) == paged_names.ATTENTIONS  # (the names host code knows)


def named(attention) -> XlaDecode | PallasDecode | RaggedDecode:
  """The kernel `attention` names (a kernel object is returned as it is).

  Raises:
    ValueError: naming the known kernels.
  """
  if not isinstance(attention, str):
    return attention
  paged_names.check_name(attention)
  return KERNELS[attention]
