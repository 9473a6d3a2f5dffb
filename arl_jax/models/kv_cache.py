"""The key/value cache of the decoder, as a small pytree of its own.

Layout is `[B, kv_heads, S, head_dim]` per layer: on XLA:CPU the `[B, S, heads,
head_dim]` layout made decode attention ~8x slower (docs/jax_notes.md), because the
score einsum transposes it on every step.

The decoder talks to a cache through two methods, so that the dense cache here
and the paged one (`paged_kv_cache.py`) are interchangeable: `layer(i)` gives a
layer view whose `update(k, v, index, write_mask, width)` writes this call's
keys/values and returns the first `width` columns of every row to attend
over (plus the updated layer), and `with_layers` puts the updated layers back.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values plus which cache positions hold real tokens.

  Attributes:
    keys: one array per layer, `[B, KVH, S, Dh]`.
    values: one array per layer, `[B, KVH, S, Dh]`.
    valid: `[B, S]` bool, True where a real (non-pad) token has been written.
  """

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  valid: jax.Array

  @classmethod
  def zeros(cls, *, batch: int, num_layers: int, num_kv_heads: int, length: int,
            head_dim: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, num_kv_heads, length, head_dim)
    return cls(
        keys=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        values=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        valid=jnp.zeros((batch, length), jnp.bool_),
    )

  @property
  def length(self) -> int:
    """S, columns of every row."""
    return self.valid.shape[1]

  def layer(self, i: int) -> DenseLayer:
    return DenseLayer(keys=self.keys[i], values=self.values[i])

  def with_layers(self, layers) -> KVCache:
    return self.replace(keys=tuple(layer.keys for layer in layers),
                        values=tuple(layer.values for layer in layers))

  def write_prefill(self, slots: jax.Array, prefill: KVCache) -> KVCache:
    """Writes a prefill's cache (`[R, KVH, Pb, Dh]` per layer, every row from
    column 0) into columns `[0, Pb)` of rows `slots` `[R]`."""
    pb = prefill.length
    return self.replace(
        keys=tuple(k.at[slots, :, :pb].set(s) for k, s in zip(self.keys, prefill.keys)),
        values=tuple(v.at[slots, :, :pb].set(s) for v, s in zip(self.values, prefill.values)))

  def fork_rows(self, src: jax.Array, dst: jax.Array, shared: jax.Array) -> KVCache:
    """Rows `dst` `[R]` take the keys and values of rows `src` `[R]`, and
    their valid columns before `shared` `[R]` (a group's samples start from
    one prefilled prompt: `sampling.fork`)."""
    columns = jnp.arange(self.length)[None, :]
    return self.replace(
        keys=tuple(k.at[dst].set(k[src]) for k in self.keys),
        values=tuple(v.at[dst].set(v[src]) for v in self.values),
        valid=self.valid.at[dst].set(self.valid[src] & (columns < shared[:, None])))

  def rows_view(self, rows: jax.Array, valid: jax.Array) -> KVCache:
    """The cache of rows `rows` `[R]` alone, with `valid` `[R, W]` their valid
    columns: a model call over some slots (`sampler/prefill_chunks.py`)
    writes it, and `put_rows` puts it back."""
    return KVCache(keys=tuple(k[rows] for k in self.keys),
                   values=tuple(v[rows] for v in self.values), valid=valid)

  def put_rows(self, rows: jax.Array, view: KVCache, valid: jax.Array) -> KVCache:
    """This cache with `rows_view(rows, ...)`'s updated keys and values back
    in rows `rows`, and `valid` `[B, S]` as every row's valid columns."""
    return self.replace(keys=tuple(k.at[rows].set(r) for k, r in zip(self.keys, view.keys)),
                        values=tuple(v.at[rows].set(r) for v, r in zip(self.values, view.values)),
                        valid=valid)

  def logical_axes(self) -> KVCache:
    """This cache's structure with each array's logical axis names in its
    place, for `rules.array_shardings` (a rule table places the heads like
    the attention weights that produce them)."""
    layer = ("batch", "kv_heads", "length", "head_dim")
    return KVCache(keys=tuple(layer for _ in self.keys), values=tuple(layer for _ in self.values),
                   valid=("batch", "length"))


@flax.struct.dataclass
class DenseLayer:
  """One layer of a `KVCache`: `[B, KVH, S, Dh]` keys and values."""

  keys: jax.Array
  values: jax.Array

  # Attention runs in the decoder, over what `update` returns (a paged
  # layer may attend itself: `paged_kv_cache.PagedLayer.attend`).
  attends = False

  def update(self, k: jax.Array, v: jax.Array, index: jax.Array,
             write_mask: jax.Array | None, width: int):
    """Writes `k`, `v` `[B, KVH, T, Dh]` at per-row offsets `index` `[B]`
    (rows where `write_mask` is False keep theirs); returns the first `width`
    columns of the updated keys and values, and the updated layer."""
    keys = write(self.keys, k, index, write_mask)
    values = write(self.values, v, index, write_mask)
    return keys[:, :, :width], values[:, :, :width], DenseLayer(keys=keys, values=values)


def write(cache_layer: jax.Array, new: jax.Array, index: jax.Array,
          write_mask: jax.Array | None = None) -> jax.Array:
  """Writes `new` `[B, KVH, T, Dh]` into `cache_layer` at per-row offsets `index` `[B]`.

  Rows where `write_mask` `[B]` is False keep their old entries (the engine
  decodes only some slots per call when it serves several pinned versions).
  """
  if write_mask is not None:
    # Re-write what is there rather than select between whole caches: the
    # select would copy the full cache on every decode step.
    old = jax.vmap(lambda c, i: jax.lax.dynamic_slice_in_dim(c, i, new.shape[2], axis=1))(
        cache_layer, index)
    new = jnp.where(write_mask[:, None, None, None], new, old)
  # vmap over rows so that every row may sit at its own offset (continuous
  # batching refills slots at different positions).
  return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis=1))(
      cache_layer, new, index)


def write_valid(valid: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
  """Writes `new` `[B, T]` bool into `valid` `[B, S]` at per-row offsets `index` `[B]`."""
  return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis=0))(
      valid, new, index)
