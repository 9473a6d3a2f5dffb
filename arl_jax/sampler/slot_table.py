"""`SlotTable`: the sampler engine's host view of its slots: the row in each,
which finished as of the last read of the device's `done`, and which the
next decode must end on the device (their occupant was cancelled or
preempted, and the slot freed at once)."""

from __future__ import annotations

import numpy as np

from arl_jax.sampler import waiting_rows


class SlotTable:
  """Attributes:
    rows: the `waiting_rows.Row` occupying each slot (None: free).
    done: `[B]` bool, finished as of the last device read (`read_done`).
    stop: `[B]` bool, slots to end on the device at the next decode.
  """

  def __init__(self, num_slots: int):
    self.rows: list[waiting_rows.Row | None] = [None] * num_slots
    self.done = np.zeros((num_slots,), bool)
    self.stop = np.zeros((num_slots,), bool)

  def free(self) -> list[int]:
    return [i for i, row in enumerate(self.rows) if row is None]

  @property
  def active(self) -> int:
    """Slots holding a row (decoding, prefilling or waiting to fork)."""
    return sum(row is not None for row in self.rows)

  def occupied(self, held: set[int] = frozenset()) -> np.ndarray:
    """`[B]` bool, the slots holding a row, except `held` ones."""
    return np.array([row is not None and i not in held for i, row in enumerate(self.rows)])

  def finished(self, held: set[int]) -> list[int]:
    """The occupied slots, except `held` ones, whose segment has ended."""
    return np.flatnonzero(self.occupied(held) & self.done).tolist()

  def read_done(self, state) -> None:
    """Reads which slots are done from the device (a small host sync)."""
    self.done = np.array(state.done)

  def check(self, held: set[int], pool) -> None:
    """Asserts that a free slot is neither `held` (prefilling, or a fork
    waiting) nor holding pages of `pool` (a `page_pool.PagePool`, or None),
    and that an occupied one has a version and stays within its budget."""
    for slot, row in enumerate(self.rows):
      if row is None:
        assert slot not in held, f"free slot {slot} is prefilling"
        assert pool is None or pool.held(slot) == 0, f"free slot {slot} holds pages"
      else:
        assert row.version >= 0, f"slot {slot}: no version"
        assert row.sampled >= 0 and (self.done[slot] or row.sampled <= row.budget), (
            f"slot {slot}: sampled {row.sampled} of a budget of {row.budget}")
