"""Decode attention over a paged KV pool with JAX's Pallas paged attention
kernel (`jax.experimental.pallas.ops.gpu.paged_attention`).

The kernel reads each row's pages from its page table itself and attends
over the row's first `length` columns, so a decode step reads the pages a
row holds and no gathered `[B, KVH, width, Dh]` copy is made. It is the GPU
kernel (Triton through Pallas); in interpret mode (`"pallas_interpret"`) it
runs anywhere, which is how its numerics are tested on CPU against the XLA
path (`tests/models/paged_attention_test.py`). TPU's ragged paged attention
kernel takes another pool layout (keys and values interleaved per head) and
is not wired yet.

The kernel's pool layout is `[KVH, pages, page_size, Dh]` (ours,
`paged_kv_cache.py`), its queries `[B, H, Dh]` grouped as the decoder groups
them (head h reads KV head `h // (H / KVH)`); it does not scale the scores,
so queries come scaled.
"""

from __future__ import annotations

import jax

ATTENTIONS = ("xla", "pallas", "pallas_interpret")

# The kernel's query block: q heads per KV head are padded up to it.
_BLOCK_H = 16
_MAX_PAGES_PER_BLOCK = 8


def check_name(attention: str) -> None:
  if attention not in ATTENTIONS:
    raise ValueError(f"paged attention must be one of {ATTENTIONS}, got {attention!r}")


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
