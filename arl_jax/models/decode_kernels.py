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
from typing import ClassVar

import jax

from arl_jax.models import paged_attention, paged_names


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
    from arl_jax.models import paged_kv_cache  # noqa: PLC0415 - (it imports this module)

    out, keys = paged_kv_cache.ragged_attend(layer.keys, layer.page_table, q, k, v, index,
                                             write_mask, width, layer.mesh)
    return out, layer.replace(keys=keys)


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
