"""Batch assembly policies and the buffer's sweep."""

import threading

from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import orchestrator_config
from tests.orchestrator.staleness_test import make_group


def _buffer(assembly, window_groups=1, k=8):
  # (the window is a fraction of a batch: of 100 groups here)
  return buffer_lib.RolloutBuffer(orchestrator_config.OrchestratorConfig(
      batch_size=200, group_size=2, max_off_policy_steps=k, assembly=assembly,
      window_fraction=window_groups / 100))


def _dispatch(buffer, n, version=0):
  for gid in range(n):
    buffer.register_dispatch(gid, version)


def test_fifo_waits_for_the_head_of_the_dispatch_queue():
  buffer = _buffer("fifo")
  _dispatch(buffer, 4)
  for gid in (1, 2, 3):
    buffer.put(make_group(gid, 0, [[0], [0]]), live_version=0)
  assert buffer.try_cut(0, 2).groups is None
  buffer.put(make_group(0, 0, [[0], [0]]), live_version=0)
  assert [g.group_id for g in buffer.try_cut(0, 2).groups] == [0, 1]


def test_first_done_takes_completion_order():
  buffer = _buffer("first_done")
  _dispatch(buffer, 4)
  for gid in (3, 1):
    buffer.put(make_group(gid, 0, [[0], [0]]), live_version=0)
  assert [g.group_id for g in buffer.try_cut(0, 2).groups] == [3, 1]


def test_windowed_fifo_takes_out_of_order_only_inside_the_window():
  buffer = _buffer("windowed_fifo", window_groups=2)
  _dispatch(buffer, 5)
  for gid in (1, 3, 4):
    buffer.put(make_group(gid, 0, [[0], [0]]), live_version=0)
  # Window [0, 1]: 1 may go first; then window [0, 2]: nothing finished -> wait.
  assert buffer.try_cut(0, 2).groups is None
  buffer.put(make_group(2, 0, [[0], [0]]), live_version=0)
  # Window [0, 1] -> 1; window [0, 2] -> 2.
  assert [g.group_id for g in buffer.try_cut(0, 2).groups] == [1, 2]


def test_cancelled_group_leaves_the_dispatch_queue():
  buffer = _buffer("fifo")
  _dispatch(buffer, 2)
  buffer.forget(0)
  assert buffer.put(make_group(1, 0, [[0], [0]]), live_version=0)
  # Arrives after cancellation: ignored.
  assert not buffer.put(make_group(0, 0, [[0], [0]]), live_version=0)
  result = buffer.try_cut(0, 1)
  assert [g.group_id for g in result.groups] == [1]
  assert len(buffer) == 0


def test_wait_for_change_wakes_on_put_and_close():
  buffer = _buffer("fifo")
  _dispatch(buffer, 1)
  generation = buffer.generation
  assert not buffer.wait_for_change(generation, timeout=0.01)
  threading.Timer(0.1, lambda: buffer.put(make_group(0, 0, [[0], [0]]), 0)).start()
  assert buffer.wait_for_change(generation, timeout=5)
  assert len(buffer) == 1
  generation = buffer.generation
  threading.Timer(0.1, buffer.close).start()
  assert buffer.wait_for_change(generation, timeout=5)
  assert buffer.closed


def test_every_cut_attempt_sweeps_and_reports_its_stale_groups():
  buffer = _buffer("fifo", k=1)
  _dispatch(buffer, 3)
  buffer.put(make_group(0, 0, [[0], [0]]), live_version=1)
  buffer.put(make_group(1, 0, [[0], [0]]), live_version=1)
  result = buffer.try_cut(2, 1)  # both are 2 versions old with K=1: swept
  assert result.groups is None
  assert sorted(g.group_id for g in result.stale) == [0, 1]
  assert len(buffer) == 0
  buffer.register_dispatch(3, 2)
  buffer.forget(2)
  group = make_group(3, 2, [[2], [2]])
  buffer.put(group, live_version=2)
  result = buffer.try_cut(2, 1)
  assert [g.group_id for g in result.groups] == [3] and result.stale == []
  assert group.arrival_version == 2


def test_cancelling_a_group_that_already_arrived_removes_it():
  buffer = _buffer("first_done")
  _dispatch(buffer, 2)
  buffer.put(make_group(0, 0, [[0], [0]]), live_version=0)
  buffer.put(make_group(1, 0, [[0], [0]]), live_version=0)
  buffer.forget(0)
  assert len(buffer) == 1
  result = buffer.try_cut(0, 1)
  assert [g.group_id for g in result.groups] == [1] and result.stale == []
