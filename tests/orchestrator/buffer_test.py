"""Batch assembly policies and the buffer's blocking behaviour."""

import threading

import pytest

from arl_jax.orchestrator import buffer as buffer_lib
from tests.orchestrator.staleness_test import make_group


def _buffer(assembly, window_groups=1, k=8):
  return buffer_lib.RolloutBuffer(buffer_lib.BufferConfig(
      max_off_policy_steps=k, assembly=assembly, window_groups=window_groups))


def _dispatch(buffer, n, version=0):
  for gid in range(n):
    buffer.register_dispatch(gid, version)


def test_fifo_waits_for_the_head_of_the_dispatch_queue():
  buffer = _buffer("fifo")
  _dispatch(buffer, 4)
  for gid in (1, 2, 3):
    buffer.put(make_group(gid, 0, [[0], [0]]))
  with pytest.raises(TimeoutError):
    buffer.cut(0, 2, timeout=0.05)
  buffer.put(make_group(0, 0, [[0], [0]]))
  assert [g.group_id for g in buffer.cut(0, 2, timeout=0.05).groups] == [0, 1]


def test_first_done_takes_completion_order():
  buffer = _buffer("first_done")
  _dispatch(buffer, 4)
  for gid in (3, 1):
    buffer.put(make_group(gid, 0, [[0], [0]]))
  assert [g.group_id for g in buffer.cut(0, 2, timeout=0.05).groups] == [3, 1]


def test_windowed_fifo_takes_out_of_order_only_inside_the_window():
  buffer = _buffer("windowed_fifo", window_groups=2)
  _dispatch(buffer, 5)
  for gid in (1, 3, 4):
    buffer.put(make_group(gid, 0, [[0], [0]]))
  # Window [0, 1]: 1 may go first; then window [0, 2]: nothing finished -> wait.
  with pytest.raises(TimeoutError):
    buffer.cut(0, 2, timeout=0.05)
  buffer.put(make_group(2, 0, [[0], [0]]))
  # Window [0, 1] -> 1; window [0, 2] -> 2.
  assert [g.group_id for g in buffer.cut(0, 2, timeout=0.05).groups] == [1, 2]


def test_cancelled_group_leaves_the_dispatch_queue():
  buffer = _buffer("fifo")
  _dispatch(buffer, 2)
  buffer.forget(0)
  buffer.put(make_group(1, 0, [[0], [0]]))
  buffer.put(make_group(0, 0, [[0], [0]]))  # arrives after cancellation: ignored
  result = buffer.cut(0, 1, timeout=0.05)
  assert [g.group_id for g in result.groups] == [1]
  assert len(buffer) == 0


def test_cut_blocks_until_a_group_arrives_and_close_unblocks():
  buffer = _buffer("fifo")
  _dispatch(buffer, 1)
  threading.Timer(0.1, lambda: buffer.put(make_group(0, 0, [[0], [0]]))).start()
  assert [g.group_id for g in buffer.cut(0, 1, timeout=5).groups] == [0]
  threading.Timer(0.1, buffer.close).start()
  with pytest.raises(buffer_lib.BufferClosed):
    buffer.cut(0, 1, timeout=5)


def test_groups_swept_during_a_timed_out_cut_are_reported_by_the_next_cut():
  buffer = _buffer("fifo", k=1)
  _dispatch(buffer, 3)
  buffer.put(make_group(0, 0, [[0], [0]]))
  buffer.put(make_group(1, 0, [[0], [0]]))
  with pytest.raises(TimeoutError):
    buffer.cut(2, 1, timeout=0.05)  # both are 2 versions old with K=1: swept
  assert len(buffer) == 0
  buffer.register_dispatch(3, 2)
  buffer.forget(2)
  buffer.put(make_group(3, 2, [[2], [2]]))
  result = buffer.cut(2, 1, timeout=0.05)
  assert [g.group_id for g in result.groups] == [3]
  assert sorted(g.group_id for g in result.stale) == [0, 1]


def test_cancelling_a_group_that_already_arrived_removes_it():
  buffer = _buffer("first_done")
  _dispatch(buffer, 2)
  buffer.put(make_group(0, 0, [[0], [0]]))
  buffer.put(make_group(1, 0, [[0], [0]]))
  buffer.forget(0)
  assert len(buffer) == 1
  result = buffer.cut(0, 1, timeout=0.05)
  assert [g.group_id for g in result.groups] == [1] and result.stale == []
