"""What the decoder and the sampler's slot functions may use of a KV cache:
the dense `kv_cache.KVCache` and the paged `paged_kv_cache.PagedKVCache`
both implement `DecodeCache`, and their layer views `LayerCache`. A paged
layer may also attend itself through its kernel (`KernelLayer`, when
`attends`; the kernel is a `decode_kernels` strategy object).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import jax


@runtime_checkable
class LayerCache(Protocol):
  """One layer's keys and values, as the decoder's attention uses them."""

  @property
  def attends(self) -> bool:
    """Whether a decode step's attention runs in the cache's kernel (then the
    layer is a `KernelLayer`), not in the decoder."""

  def update(self, k: jax.Array, v: jax.Array, index: jax.Array,
             write_mask: jax.Array | None, width: int):
    """Writes `k`, `v` `[B, KVH, T, Dh]` at per-row offsets `index` `[B]`;
    returns the first `width` columns of every row's keys and values and
    the updated layer."""


@runtime_checkable
class KernelLayer(LayerCache, Protocol):
  """A layer whose decode step attends in its kernel."""

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, index: jax.Array,
             write_mask: jax.Array | None, width: int):
    """Writes this step's `k`, `v` and attends `q` `[B, H, Dh]` over each
    row's columns `[0, index]`: `(out [B, H, Dh], layer)`."""


@runtime_checkable
class DecodeCache(Protocol):
  """A whole cache: rows (slots) of `length` columns, one layer view each."""

  @property
  def length(self) -> int:
    """Columns of every row."""

  def layer(self, i: int) -> LayerCache:
    """Layer `i`'s view."""

  def with_layers(self, layers: Sequence[LayerCache]) -> DecodeCache:
    """This cache with every layer's updated view put back."""

  def write_prefill(self, slots: jax.Array, prefill) -> DecodeCache:
    """A prefill's dense cache written into columns `[0, Pb)` of rows `slots`."""

  def fork_rows(self, src: jax.Array, dst: jax.Array, shared: jax.Array) -> DecodeCache:
    """Rows `dst` start from rows `src`'s first `shared` columns."""

  def rows_view(self, rows: jax.Array, valid: jax.Array) -> DecodeCache:
    """The cache of rows `rows` alone (a model call over some slots)."""

  def put_rows(self, rows: jax.Array, view: DecodeCache, valid: jax.Array) -> DecodeCache:
    """`rows_view`'s updated rows back in place."""

  def logical_axes(self) -> DecodeCache:
    """This cache's structure with each array's logical axis names."""
