"""How the sampler engine's slots hold their KV cache (`EngineConfig.kv_cache`).

`DenseSlots`: every slot owns `length` columns of the cache for good, so
nothing is allocated, and a decode step attends over every column.

`PagedSlots`: slots take pages of a shared pool (`page_pool.py`,
`models/paged_kv_cache.py`): at admission for the context and the column of
the first sampled token, and one more each time a decode step's write crosses
a page boundary; they give them all back when the segment ends, the group is
cancelled or the slot is preempted; the samples of a group share their
prompt's pages (`admit_fork`). Admission waits for free pages. When a
live slot needs a page and none is free, the youngest live slot is
preempted: the engine keeps what it sampled of its segment as the episode's
open segment (tokens, log-probs, versions; `keep_open_segment`) and queues it
ahead of new work, to be prefilled again under the weights live then and go
on with the draws it would have made (as a resumed checkpoint's open segment
does). A pool holds at least one longest sequence, so the oldest slot always
proceeds and the engine never deadlocks.

A paged decode step groups the slots by the columns their contexts need
(`EngineConfig.decode_span`: whole attention blocks, or one of the compiled
`decode_widths`) and decodes each group in its own call
(`paged_decode.decode_rows`, merged when one call is cheaper: `calls`), so attention
reads about each slot's own pages, not the longest context's for every slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from arl_jax.core import episode as episode_lib
from arl_jax.sampler import engine_config, page_pool

# The cost model `PagedSlots.calls` merges width groups by, in attended
# columns: a row's model pass besides attention, and a call's overhead per slot.
_ROW_COST = 64
_CALL_COST = 16


class DenseSlots:
  """Every slot holds its full length: admission always fits, nothing grows."""

  def admit(self, slot: int, context_len: int) -> bool:
    """Whether `slot` can take a context of `context_len` tokens (its pages
    are taken if so)."""
    del slot, context_len
    return True

  def admit_fork(self, slot: int, source: int, context_len: int) -> bool:
    """Whether `slot` can start on the prompt (of `context_len` tokens) that
    `source` was just admitted with (`sampling.fork`)."""
    del slot, source, context_len
    return True

  def release(self, slot: int) -> None:
    del slot

  def grow(self, rows: Sequence, done, preempt: Callable[[int], None], steps: int = 1) -> None:
    """Before a decode call of `steps` steps: room for every live slot's writes."""
    del rows, done, preempt, steps

  def width(self, rows: Sequence) -> int | None:
    """The width (columns) a recompute of the occupied `rows` reads (None: all)."""
    del rows

  def calls(self, rows: Sequence, mask: np.ndarray, steps: int = 1
            ) -> list[tuple[int | None, object]]:
    """`(span, slot indices)` of the calls that decode the slots of `mask`
    (`[B]` bool; `rows` the table's) for `steps` steps: dense, one call over
    the mask (`(None, None)`)."""
    del rows, mask, steps
    return [(None, None)]

  def page_table(self):
    """The host page table when the device's copy is stale (then it is
    current again), else None."""
    return None

  @property
  def peak_pages(self) -> int:
    return 0


class PagedSlots(DenseSlots):
  """Slots backed by a `PagePool`; see the module docstring."""

  def __init__(self, cfg: engine_config.EngineConfig):
    self._cfg = cfg
    self.pool = page_pool.PagePool(num_pages=cfg.pool_pages, page_size=cfg.page_size,
                                   num_slots=cfg.num_slots, length=cfg.length)

  def admit(self, slot: int, context_len: int) -> bool:
    # The context fills columns [0, context_len) and the first decode step
    # writes the first sampled token's keys at column `context_len`.
    return self.pool.take(slot, 0, context_len)

  def admit_fork(self, slot: int, source: int, context_len: int) -> bool:
    # The prompt's pages are shared up to the one holding its last column,
    # which the fork writes again (copied), and the next (the first sample).
    self.pool.share(slot, source, (context_len - 1) // self._cfg.page_size)
    if self.pool.take(slot, context_len - 1, context_len):
      return True
    self.pool.release(slot)
    return False

  def release(self, slot: int) -> None:
    self.pool.release(slot)

  def grow(self, rows: Sequence, done, preempt: Callable[[int], None], steps: int = 1) -> None:
    """Gives every live slot the pages its next `steps` writes land in (up to
    its last writable column), calling `preempt(slot)` on the youngest live
    slot while the pool has none free (`preempt` must free the slot:
    `rows[slot]` None afterwards)."""
    for slot, row in enumerate(rows):
      if row is None or done[slot]:
        continue
      first = row.last_column
      last = max(first, min(first + steps - 1, self._last_write(row)))
      while rows[slot] is row and not self.pool.take(slot, first, last):
        live = [s for s, r in enumerate(rows) if r is not None and not done[s]]
        preempt(max(live, key=lambda s: (rows[s].start_time, s)))

  def _last_write(self, row) -> int:
    """The last column `row` can write keys and values at: the one before
    its last sampled token's (`sampling.insert`'s `limit`)."""
    return min(row.first_column + row.budget - 1, self._cfg.length - 1) - 1

  def width(self, rows: Sequence) -> int:
    last = max((row.last_column for row in rows if row is not None), default=0)
    return self._cfg.width_for(last)

  def calls(self, rows: Sequence, mask: np.ndarray, steps: int = 1
            ) -> list[tuple[int | None, object]]:
    """`(span, slot indices)` of the calls that decode the slots of `mask`
    for `steps` steps: slots grouped by the columns their last write needs
    (`EngineConfig.decode_span`), a group merged into the next wider one when
    one call costs less than two (a call costs its row bucket times its span
    plus `_ROW_COST` columns per row, plus `_CALL_COST`), indices padded to
    a row bucket by repeating the last."""
    groups: dict[int, list[int]] = {}
    for slot in np.flatnonzero(mask):
      last = min(rows[slot].last_column + steps - 1, self._cfg.length - 1)
      groups.setdefault(self._cfg.decode_span(last), []).append(int(slot))
    b = self._cfg.num_slots
    cost = lambda n, width: (engine_config.row_bucket(n, b) * (width + _ROW_COST)
                             + _CALL_COST * b)
    merged: list[tuple[int, list[int]]] = []
    for width, members in sorted(groups.items()):
      if merged and cost(len(merged[-1][1]) + len(members), width) <= (
          cost(len(merged[-1][1]), merged[-1][0]) + cost(len(members), width)):
        members = merged.pop()[1] + members
      merged.append((width, members))
    pad = lambda m: m + [m[-1]] * (engine_config.row_bucket(len(m), b) - len(m))
    return [(width, np.array(pad(m), np.int32)) for width, m in merged]

  def page_table(self):
    if not self.pool.changed:
      return None
    self.pool.changed = False
    return self.pool.table.copy()

  @property
  def peak_pages(self) -> int:
    return self.pool.peak_in_use


def make(cfg: engine_config.EngineConfig) -> DenseSlots:
  return PagedSlots(cfg) if cfg.paged else DenseSlots()


def keep_open_segment(episode: episode_lib.Episode, segment) -> int:
  """Makes what a preempted slot sampled of its segment (a
  `slot_fns.Segment`, from its first completion column: an open segment it
  was admitted with comes first) the episode's open segment; returns how
  many of the tokens are new."""
  new = len(segment.tokens) - len(episode.open_tokens)
  episode.open_alternatives = episode.with_open_alternatives(segment.alternatives)
  episode.open_tokens = [int(t) for t in segment.tokens]
  episode.open_logprobs = [float(x) for x in segment.logprobs]
  episode.open_versions = [int(v) for v in segment.versions]
  return new
