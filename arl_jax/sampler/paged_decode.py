"""The slot functions of a paged state (`models/paged_kv_cache.py`) that a
dense one has no use for: decoding a subset of the slots, reading only
their pages (`decode_rows`), and taking up the host's page table
(`set_page_table`). Pure, as `sampling.py`'s.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from arl_jax.models import paged_blocks
from arl_jax.sampler import sampling, token_draw


def decode_rows(graphdef, params, version, state: sampling.SlotState, stop_rows, rows,
                blocks=None, *, settings: sampling.SamplingSettings,
                width: int | None = None, steps: int = 1,
                block: int = 0) -> sampling.SlotState:
  """`sampling.decode_step` for the slots `rows` only: a paged cache's pool is shared
  by every slot, so a call runs the model on `[R]` rows and reads only their
  pages. The engine calls it once per group of slots whose contexts need
  about the same columns (`kv_slots.PagedSlots.calls`), so a step's
  attention follows each slot's own context, not the longest.

  Args:
    graphdef, params, version, state, settings, steps: as
      `sampling.decode_step` (a paged state).
    stop_rows: `[B]` bool, slots to end before this step.
    rows: `[R]` int32 slots to decode (a repeated slot gets identical results).
    blocks: int32 scalar, with `block`: blocks of `block` columns attended
      over, read one at a time (they hold every slot's last column, after
      every step; one program for every count: `paged_blocks.py`).
    width: static, without `block`: columns attended over, gathered at
      once (a program per width).
    block: static, columns per block (0: gather `width` columns).
  """
  model = nnx.merge(graphdef, params)
  step = lambda _, s: _decode_rows_once(model, version, s, rows, settings, width, blocks, block)
  return sampling.repeat_steps(step, state.replace(done=state.done | stop_rows), steps)


def _decode_rows_once(model, version, state: sampling.SlotState, rows, settings, width, blocks,
                      block) -> sampling.SlotState:
  """One decode step of the live slots among `rows` (`decode_rows`)."""
  length = state.tokens.shape[1]
  live = ~state.done[rows]
  last = state.index[rows]
  valid = state.cache.valid.at[rows, last].set(state.cache.valid[rows, last] | live)
  if block:
    row_valid = valid[rows]
    attn = paged_blocks.Blocks(valid=row_valid, columns=last[:, None], count=blocks,
                               block=block)
  else:
    row_valid = valid[rows, :width]
    attn = row_valid[:, None, :] & (jnp.arange(width)[None, None, :] <= last[:, None, None])
  view = state.cache.replace(valid=row_valid, page_table=state.cache.page_table[rows])
  logits, view = model(state.tokens[rows, last][:, None], state.positions[rows][:, None], attn,
                       view, last, write_mask=live)
  state = state.replace(
      cache=state.cache.replace(keys=view.keys, values=view.values, valid=valid),
      positions=state.positions.at[rows].set(state.positions[rows] + live.astype(jnp.int32)))
  columns = jnp.minimum(last + 1, length - 1)
  draw = token_draw.sample_from_logits(logits[:, 0], state.keys[rows],
                                      columns - state.prompt_end[rows], settings)
  return sampling.record_tokens(state, live, columns, draw, version, settings, rows=rows)


def set_page_table(state: sampling.SlotState, page_table) -> sampling.SlotState:
  """The state with the paged cache's page table `[B, L / page_size]` the
  host's page pool holds now (`sampler/page_pool.py`)."""
  return state.replace(cache=state.cache.replace(page_table=page_table))
