"""Paged attention read in blocks of pages, as many as the rows need.

`paged_kv_cache.PagedLayer.update` gathers a static `width` of columns, so a
paged engine compiles one decode program per width
(`EngineConfig.decode_widths`: seven at 1,056-column slots, ten at 8,224)
times row bucket times step count; a compile each, before the first token,
and the count grows with the context. Here the width is data: attention
loops over blocks of `block` columns (whole pages), the trip count an
argument of the call, keeping a running max, normaliser and weighted sum
(the online softmax of FlashAttention, Dao et al. 2022; vLLM's paged
attention reads pages the same way). A decode step still reads only the
blocks its rows need, so one program per row bucket serves every context
length (`paged_decode.decode_rows` with `block` set); a prefill chunk
(`prefill_chunks.prefill_chunk`) reads its rows' pages the same way, one
program per row bucket.

Every row's column 0 is a real token (rows start at column 0), so the first
block sets each query's running max to a real score; masked scores are a
large finite negative, as in the decoder, so a row with nothing to attend
(a finished row, whose output is ignored) stays finite. A slot that one
block holds runs the block without the loop: on a CPU the loop's machinery
cost ~18% of a decode step of SmolLM2-135M at one iteration
(`benchmarks/README.md`, `real_size.py`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

_MASK_VALUE = -1e30  # as `decoder._MASK_VALUE`: finite, so masked rows never make NaNs


@flax.struct.dataclass
class Blocks:
  """What a call attends: passed in place of the decoder's `[B, T, S]` mask
  (`decoder.Attention`), with a paged cache.

  Attributes:
    valid: `[B, L]` bool, the rows' written columns (this call's included).
    columns: `[B, T]` int32, the column of each query: it attends the valid
      columns up to and including it (a decode step: each row's last
      column; a prefill chunk: the chunk's columns, causally).
    count: int32 scalar (traced), blocks to read: they hold every query's
      column (`EngineConfig.decode_span`).
    block: static, columns per block (a multiple of the page size).
  """

  valid: jax.Array
  columns: jax.Array
  count: jax.Array
  block: int = flax.struct.field(pytree_node=False, default=128)


def attend(q: jax.Array, read_block, table: jax.Array, blocks: Blocks) -> jax.Array:
  """Attention of each row's queries over its valid columns up to theirs, a
  block at a time.

  Args:
    q: `[B, T, H, Dh]` queries, already scaled by `1 / sqrt(Dh)`; head h
      reads KV head `h // (H / KVH)` (as the decoder groups them).
    read_block: `(pages [B, block / page_size]) -> (keys, values)`, each
      `[B, KVH, block, Dh]`: the columns those pages hold.
    table: `[B, P]` int32 page tables.
    blocks: the rows' columns and the blocks to read.

  Returns:
    `[B, T, H, Dh]` float32.
  """
  b, t, h, dh = q.shape
  length = blocks.valid.shape[1]
  page_size = length // table.shape[1]
  if blocks.block % page_size:
    raise ValueError(f"an attention block ({blocks.block} columns) must hold whole pages of "
                     f"{page_size}")
  per_block = blocks.block // page_size
  # Pad to whole blocks: a slice past the end would be clamped back onto real columns.
  spare = -length % blocks.block
  table = jnp.pad(table, ((0, 0), (0, spare // page_size)))  # page 0: the trash page
  valid = jnp.pad(blocks.valid, ((0, 0), (0, spare)))
  kvh = jax.eval_shape(read_block, table[:, :per_block])[0].shape[1]
  qg = q.astype(jnp.float32).reshape(b, t, kvh, h // kvh, dh)  # [B, T, KVH, G, Dh]

  def step(i, carry):
    peak, total, acc = carry  # [B, T, KVH, G], the same, [B, T, KVH, G, Dh]
    pages = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
    keys, values = read_block(pages)  # [B, KVH, block, Dh]
    columns = i * blocks.block + jnp.arange(blocks.block)
    mask = (jax.lax.dynamic_slice_in_dim(valid, i * blocks.block, blocks.block, axis=1)[:, None]
            & (columns[None, None, :] <= blocks.columns[:, :, None]))  # [B, T, block]
    scores = jnp.einsum("btkgd,bksd->btkgs", qg, keys.astype(jnp.float32))
    scores = jnp.where(mask[:, :, None, None, :], scores, _MASK_VALUE)
    new_peak = jnp.maximum(peak, scores.max(axis=-1))
    weights = jnp.exp(scores - new_peak[..., None])
    scale = jnp.exp(peak - new_peak)
    total = total * scale + weights.sum(axis=-1)
    acc = acc * scale[..., None] + jnp.einsum("btkgs,bksd->btkgd", weights,
                                              values.astype(jnp.float32))
    return new_peak, total, acc

  shape = (b, t, kvh, h // kvh)
  carry = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
           jnp.zeros((*shape, dh), jnp.float32))
  if length <= blocks.block:  # one block holds the slot: no loop to run
    _, total, acc = step(0, carry)
  else:
    _, total, acc = jax.lax.fori_loop(0, blocks.count, step, carry)
  return (acc / total[..., None]).reshape(b, t, h, dh)
