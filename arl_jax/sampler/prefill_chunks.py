"""Chunked prefill: a long context enters its slot a chunk of columns at a
time, between decode steps, so that one long prompt (or a long multi-turn,
preempted or restored context) does not stall every live slot for its whole
prefill (`EngineConfig.prefill_chunk`).

`begin` writes a row's context, its segment's fields and its PRNG key into
the slot, with nothing in the cache yet; the slot is not done, but the
engine keeps it out of decode calls until its last chunk. Each
`prefill_chunk` call then runs the model on the next `chunk` columns of each
row it is given, at that row's place in the slot, attending over the slot's
cache (the chunks before it and itself, causally): keys and values go
straight into the slot's cache (dense rows or pool pages). The last chunk of
a row ends at the end of its context and samples the segment's first token, with
the draw `sampling.insert` would have made (same key, same offset), so a
chunked prefill samples what an unchunked one does, up to the float
rounding of computing the same keys in another shape.

Chunks are right-aligned: the last covers `[n - chunk, n)` of a context of
n tokens (columns `[0, n)` of its row, `sampling.py`), the ones before it
step back by `chunk` columns, and the first is clamped at column 0 (it may
then overlap the second, whose columns are computed again: the same keys
and values).
The slot's `index` is the end of the columns prefilled so far, so the
`recompute` KV policy re-prefills exactly those after a swap.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from arl_jax.models import paged_blocks
from arl_jax.sampler import sampling, token_draw


def begin(state: sampling.SlotState, base_key, slots, tokens, token_mask, logprobs, versions,
          key_ids, max_new_tokens, stop_mask, context_len, open_len,
          first) -> sampling.SlotState:
  """Puts R contexts in slots `slots`, to be prefilled by `prefill_chunk`.

  Args:
    state: the slot state.
    base_key: `[2]` uint32, `jax.random.PRNGKey(seed)`.
    slots: `[R]` int32 slots to fill (a repeated slot gets an identical row).
    tokens: `[R, L]` int32, each context from column 0, then pad.
    token_mask: `[R, L]` bool, True on context tokens.
    logprobs: `[R, L]` float32, recorded log-probs of an open segment at the
      end of the context (as `sampling.insert`'s `open_logprobs`), else 0.
    versions: `[R, L]` int32, their versions, else `NO_VERSION`.
    key_ids: `[R, 3]` uint32 (group id, sample index, turn) of each row.
    max_new_tokens: `[R]` int32 completion budget of each row's segment.
    stop_mask: `[R, S]` bool, which of the stop ids end each row's segment.
    context_len: `[R]` int32 context tokens: the column of the first sampled token.
    open_len: `[R]` int32 open-segment tokens at the end of each context.
    first: `[R]` int32 first column of each row's first chunk.
  """
  length = state.tokens.shape[1]
  put = lambda arr, values: sampling.set_rows(arr, slots, values)
  cache = state.cache.replace(valid=put(state.cache.valid, jnp.zeros_like(token_mask)))
  return state.replace(
      cache=cache, tokens=put(state.tokens, tokens), token_mask=put(state.token_mask, token_mask),
      logprobs=put(state.logprobs, logprobs), versions=put(state.versions, versions),
      prompt_end=put(state.prompt_end, context_len - open_len),
      index=put(state.index, first),  # nothing fed before it
      limit=put(state.limit, jnp.minimum(context_len + max_new_tokens - 1, length - 1)),
      positions=put(state.positions, jnp.sum(token_mask, axis=1, dtype=jnp.int32)),
      done=put(state.done, False), stopped=put(state.stopped, False),
      stop_mask=put(state.stop_mask, stop_mask),
      keys=put(state.keys, token_draw.segment_keys(base_key, key_ids)),
      **sampling.clear_alternatives(state, slots))


def prefill_chunk(graphdef, params, version, state: sampling.SlotState, rows, start, final,
                  blocks=None, *, settings: sampling.SamplingSettings, chunk: int,
                  width: int | None, block: int = 0) -> sampling.SlotState:
  """Prefills columns `[start, start + chunk)` of the slots `rows` (begun by
  `begin`); rows whose chunk is their `final` one sample their first token.

  Args:
    graphdef: nnx graph definition of the decoder (static).
    params: the decoder params the chunk runs under.
    version: `[]` int32 version of `params` (recorded on the first tokens).
    state: the slot state.
    rows: `[R]` int32 slots (a repeated slot gets identical results).
    start: `[R]` int32 first column of each row's chunk.
    final: `[R]` bool, the chunk ends the row's context (its last).
    settings: static sampling settings.
    chunk: static, C columns per chunk.
    width: static, columns attended over (>= every `start + chunk`; None: all).
    blocks: int32 scalar, with `block`: a paged cache's columns attended
      over are read `block` at a time (`models/paged_blocks.py`), `blocks`
      of them (they hold every `start + chunk`); `width` is ignored, and one
      program serves every width.
    block: static, columns per block (0: gather `width` columns at once).
  """
  model = nnx.merge(graphdef, params)
  length = state.tokens.shape[1]
  width = length if width is None or block else width
  r = rows.shape[0]
  columns = start[:, None] + jnp.arange(chunk)[None, :]  # [R, C]
  at = (rows[:, None], columns)
  mask = state.token_mask[at]
  # A context token's RoPE position: the context tokens before it.
  positions = jnp.cumsum(state.token_mask[rows], axis=1, dtype=jnp.int32) - 1
  positions = jnp.maximum(positions[jnp.arange(r)[:, None], columns], 0)
  valid = state.cache.valid.at[at].set(state.cache.valid[at] | mask)
  row_valid = valid[rows, :width]
  if block:
    attn = paged_blocks.Blocks(valid=row_valid, columns=columns, count=blocks, block=block)
  else:
    attn = row_valid[:, None, :] & (jnp.arange(width)[None, None, :] <= columns[:, :, None])
  logits, view = model(state.tokens[at], positions, attn,
                       state.cache.rows_view(rows, row_valid), start, last_only=True)
  fed = start + chunk  # every column before it is in the cache now
  state = state.replace(cache=state.cache.put_rows(rows, view, valid),
                        index=state.index.at[rows].set(jnp.where(final, state.index[rows], fed)))
  draw = token_draw.sample_from_logits(logits[:, -1], state.keys[rows],
                                      fed - state.prompt_end[rows], settings)
  return sampling.record_tokens(state, final, fed, draw, version, settings, rows=rows)
