"""The host's page book: pages for column ranges, all-or-nothing, back on release."""

from arl_jax.sampler import page_pool


def test_pages_cover_column_ranges_and_come_back():
  pool = page_pool.PagePool(num_pages=6, page_size=4, num_slots=2, length=12)
  assert pool.usable == 5 and pool.free == 5
  assert pool.take(0, 2, 6)  # columns 2-6: blocks 0 and 1
  assert pool.held(0) == 2 and pool.changed and list(pool.table[0]) == [1, 2, 0]
  assert pool.take(0, 7, 7) and pool.held(0) == 2  # block 1 is held already
  assert pool.pages_for(0, 8, 8) == 1
  assert pool.take(1, 0, 11) and pool.free == 0 and pool.peak_in_use == 5
  assert not pool.take(0, 8, 8)  # nothing free: nothing taken
  assert pool.held(0) == 2
  pool.release(1)
  assert pool.free == 3 and list(pool.table[1]) == [0, 0, 0]
  assert pool.take(0, 8, 11) and pool.in_use == 3
  pool.release(0)
  assert pool.free == 5 and pool.in_use == 0


def test_the_trash_page_is_never_handed_out():
  pool = page_pool.PagePool(num_pages=3, page_size=2, num_slots=1, length=4)
  assert pool.take(0, 0, 3) and sorted(pool.table[0]) == [1, 2]


def test_shared_pages_stay_until_their_last_holder_lets_go():
  pool = page_pool.PagePool(num_pages=8, page_size=4, num_slots=3, length=12)
  assert pool.take(0, 2, 8)  # blocks 0-2: pages 1-3
  pool.share(1, 0, 2)  # slot 1 holds slot 0's first two pages too
  assert list(pool.table[1]) == [1, 2, 0] and pool.in_use == 3
  assert pool.take(1, 8, 8) and list(pool.table[1]) == [1, 2, 4]  # its own third page
  pool.release(0)  # pages 1 and 2 stay with slot 1; page 3 goes back
  assert pool.in_use == 3 and pool.free == 4
  pool.release(1)
  assert pool.in_use == 0 and pool.free == 7
  # The trash page of a left-padded prompt is not shared: there is none to hold.
  assert pool.take(2, 5, 6)
  pool.share(0, 2, 2)
  assert list(pool.table[0]) == [0, pool.table[2, 1], 0] and pool.held(0) == 1
