"""`PagePool`: the host's book of a paged KV cache's pages (`models/paged_kv_cache.py`).

The engine thread owns it. A slot holds the pages of the column blocks it has
written or is about to write; its unused tail points at the trash page, so
it costs nothing. Pages come from a free list: at admission
for the context and the first decode column, then one more each time a slot's
next write crosses a page boundary; they all go back at once when the slot
ends its segment, is cancelled or is preempted. The samples of a group
share their prompt's pages (`share`): a page is held by every slot whose
table names it and goes back to the free list when the last one lets go.
`table` is the device page table's host copy; `changed` says whether the
device copy is stale.
"""

from __future__ import annotations

import numpy as np

from arl_jax.models import paged_names


class PagePool:
  """Free pages and each slot's pages.

  Args:
    num_pages: pages of the pool, the trash page included (it is never handed out).
    page_size: columns per page.
    num_slots: B.
    length: L, columns of a slot (a multiple of `page_size`).
  """

  def __init__(self, *, num_pages: int, page_size: int, num_slots: int, length: int):
    if length % page_size:
      raise ValueError(f"length {length} is not a multiple of page_size {page_size}")
    self.page_size = page_size
    self.num_pages = num_pages
    self.table = np.full((num_slots, length // page_size), paged_names.TRASH_PAGE, np.int32)
    # Handed out lowest first (pop from the end): a run's pages stay compact.
    self._free = list(range(num_pages - 1, paged_names.TRASH_PAGE, -1))
    self._held: list[list[int]] = [[] for _ in range(num_slots)]
    self._holders = np.zeros((num_pages,), np.int32)  # slots holding each page
    self.changed = False
    self.peak_in_use = 0

  @property
  def free(self) -> int:
    return len(self._free)

  @property
  def usable(self) -> int:
    """Pages a slot can ever hold (all but the trash page)."""
    return self.num_pages - 1

  @property
  def in_use(self) -> int:
    return self.usable - len(self._free)

  def held(self, slot: int) -> int:
    return len(self._held[slot])

  def missing(self, slot: int, first: int, last: int) -> list[int]:
    """Column blocks of columns `[first, last]` that `slot` has no page for."""
    ps = self.page_size
    return [p for p in range(first // ps, last // ps + 1)
            if self.table[slot, p] == paged_names.TRASH_PAGE]

  def pages_for(self, slot: int, first: int, last: int) -> int:
    """Pages `slot` needs to hold every column of `[first, last]`."""
    return len(self.missing(slot, first, last))

  def take(self, slot: int, first: int, last: int) -> bool:
    """Gives `slot` pages for every column of `[first, last]` it lacks one
    for; False (and nothing taken) when the pool has too few free pages."""
    blocks = self.missing(slot, first, last)
    if len(blocks) > len(self._free):
      return False
    for block in blocks:
      self._hold(slot, block, self._free.pop())
    if blocks:
      self.changed = True
      self.peak_in_use = max(self.peak_in_use, self.in_use)
    return True

  def share(self, slot: int, source: int, blocks: int) -> None:
    """`slot` (holding nothing) holds the pages of `source`'s first `blocks`
    column blocks too (its prompt's keys and values: `sampling.fork`)."""
    if self._held[slot]:
      raise ValueError(f"slot {slot} holds pages already; it cannot share slot {source}'s")
    for block in range(blocks):
      page = int(self.table[source, block])
      if page != paged_names.TRASH_PAGE:
        self._hold(slot, block, page)
    self.changed = True

  def _hold(self, slot: int, block: int, page: int) -> None:
    self.table[slot, block] = page
    self._held[slot].append(page)
    self._holders[page] += 1

  def release(self, slot: int) -> None:
    """Lets go of every page of `slot` (its table row points at the trash
    page again); a page no other slot holds goes back to the free list."""
    if self._held[slot]:
      for page in reversed(self._held[slot]):
        self._holders[page] -= 1
        if self._holders[page] == 0:
          self._free.append(page)
      self._held[slot] = []
      self.table[slot] = paged_names.TRASH_PAGE
      self.changed = True

  def check(self) -> None:
    """Asserts the book balances: every page in use is named by a slot's
    table row, as many times as it has holders, and none is lost."""
    named, counts = np.unique(self.table[self.table != paged_names.TRASH_PAGE],
                              return_counts=True)
    assert len(named) == self.in_use, "a page in use is named by no slot (or one free is)"
    assert np.array_equal(self._holders[named], counts), "a page's holders are miscounted"
    assert self.free + self.in_use == self.usable, "pages lost"
