"""Decode attention over a paged KV pool with JAX's Pallas kernels.

Each kernel reads a row's pages from its page table itself and attends over
the row's first `length` columns, so a decode step reads the pages a row
holds and no gathered `[B, KVH, width, Dh]` copy is made.

- `"pallas"`: the GPU kernel (`jax.experimental.pallas.ops.gpu.
  paged_attention`, Triton through Pallas), over the "split" pool layout
  `[KVH, pages, page_size, Dh]` for keys and for values. In interpret mode
  (`"pallas_interpret"`) it runs anywhere, which is how its numerics are
  tested on CPU against the XLA path (`tests/models/paged_attention_test.py`).
  On one H200 (`benchmarks/attention_kernels.py`) it ran 1.3-2x the XLA path over
  gathered pages, up to 2 TB/s, with float32 results within 1.2e-4 of it.
- `"ragged"`: TPU's ragged paged attention kernel
  (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`), over the
  "interleaved" layout `[pages, page_size, 2 * KVH, Dh]` (key of KV head h at
  `2h`, its value at `2h + 1`). A decode step is its ragged batch with one
  query per row. JAX 0.10.2's TPU interpret mode cannot run it (the kernel
  reshapes a VMEM ref, which interpret mode does not support), so on CPU its
  arguments (`ragged_arguments`) are checked against the kernel's own
  reference implementation and the shape checks it runs before compiling.

Both take queries `[B, H, Dh]` grouped as the decoder groups them (head h
reads KV head `h // (H / KVH)`), already scaled by `1 / sqrt(Dh)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The ragged kernel's softmax scratch is 128 lanes wide: head_dim must fill them
# (a 64-wide head would need the pool padded, as vLLM's TPU backend does; not done).
RAGGED_HEAD_DIM = 128

# The kernel's query block: q heads per KV head are padded up to it.
_BLOCK_H = 16
_MAX_PAGES_PER_BLOCK = 8


def _largest_power_of_two_dividing(n: int, limit: int) -> int:
  p = 1
  while p * 2 <= limit and n % (p * 2) == 0:
    p *= 2
  return p


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, table: jax.Array,
                     lengths: jax.Array, *, interpret: bool = False) -> jax.Array:
  """Attention of one query per row over its paged keys and values.

  Args:
    q: `[B, H, Dh]` queries, scaled by `1 / sqrt(Dh)`.
    keys: `[KVH, N, page_size, Dh]` the key pool.
    values: likewise.
    table: `[B, P]` int32 the pages of each row's first `P * page_size` columns.
    lengths: `[B]` int32 columns each row attends over (`<= P * page_size`).
    interpret: run the kernel in Pallas interpret mode (any backend).

  Returns:
    `[B, H, Dh]` in `q`'s dtype.
  """
  from jax.experimental.pallas.ops.gpu import paged_attention as kernel  # noqa: PLC0415

  pages = table.shape[1]
  per_block = _largest_power_of_two_dividing(pages, _MAX_PAGES_PER_BLOCK)
  splits = _largest_power_of_two_dividing(pages // per_block, 16)
  return kernel.paged_attention(q, keys, values, table, lengths.astype("int32"),
                                block_h=_BLOCK_H, pages_per_compute_block=per_block,
                                k_splits=splits, interpret=interpret)


def ragged_arguments(q: jax.Array, kv_pages: jax.Array, table: jax.Array,
                     lengths: jax.Array) -> tuple[tuple, dict]:
  """The ragged kernel's arguments for one decode step: a ragged batch of B
  sequences of one query each (`cu_q_lens` 0..B), row b's query attending
  over its first `lengths[b]` columns, in the pages of `table` `[B, P]`.

  Args:
    q: `[B, H, Dh]` queries, scaled.
    kv_pages: `[N, page_size, 2 * KVH, Dh]` the interleaved pool.
    table: `[B, P]` int32 pages of each row's first `P * page_size` columns.
    lengths: `[B]` columns each row attends over (`<= P * page_size`).

  Returns:
    `(args, kwargs)` for `ragged_paged_attention` and its reference.
  """
  b = q.shape[0]
  cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32)
  num_seqs = jnp.asarray(np.array([b], np.int32))
  return ((q, kv_pages, lengths.astype(jnp.int32), table.astype(jnp.int32), cu_q_lens,
           num_seqs), {"sm_scale": 1.0})


def ragged_decode_attention(q: jax.Array, kv_pages: jax.Array, table: jax.Array,
                            lengths: jax.Array) -> jax.Array:
  """One decode step through TPU's ragged paged attention kernel (arguments
  as `ragged_arguments`). Returns `[B, H, Dh]` in `q`'s dtype."""
  from jax.experimental.pallas.ops.tpu import ragged_paged_attention as kernel  # noqa: PLC0415

  args, kwargs = ragged_arguments(q, kv_pages, table, lengths)
  return kernel.ragged_paged_attention(*args, **kwargs).astype(q.dtype)


def ragged_geometry_problem(*, num_heads: int, num_kv_heads: int, head_dim: int,
                            dtype: str) -> str | None:
  """Why TPU's ragged kernel cannot run on a device holding these heads (None:
  it can): 128-wide heads, and `2 * KVH` interleaved heads that its blocks tile
  (its own `get_min_heads_per_blk`: e.g. 3, 6 or, in bfloat16, 12 KV heads do
  not). Per device: a `tp` shard's heads."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel  # noqa: PLC0415

  if head_dim % RAGGED_HEAD_DIM:
    return (f"TPU's kernel needs a head_dim that is a multiple of {RAGGED_HEAD_DIM}; the "
            f"model's is {head_dim}")
  try:
    kernel.get_min_heads_per_blk(num_heads, 2 * num_kv_heads, jnp.dtype(dtype),
                                 jnp.dtype(dtype))
  except (ValueError, AssertionError) as e:
    return f"TPU's kernel cannot tile {num_kv_heads} KV heads in {dtype} ({e})"
  return None
