"""Admission control (the AReaL capacity rule) and cancellation."""

import itertools

from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib


class _Prompt:
  def __init__(self, i):
    self.prompt_id = i


def _dispatcher(max_async_level=1, groups_per_batch=2, k=2):
  buffer = buffer_lib.RolloutBuffer(buffer_lib.BufferConfig(max_off_policy_steps=k))
  cfg = dispatcher_lib.DispatchConfig(group_size=2, groups_per_batch=groups_per_batch,
                                      max_async_level=max_async_level, max_off_policy_steps=k)
  prompts = (_Prompt(i) for i in itertools.count())
  return dispatcher_lib.Dispatcher(cfg, prompts, lambda p: [1, 2, 3], buffer), buffer


def test_capacity_is_max_async_level_plus_one_batches():
  dispatcher, _ = _dispatcher(max_async_level=1, groups_per_batch=2)
  got = dispatcher.take(10, live_version=0, timeout=0.01)
  assert [r.group_id for r in got] == [0, 1, 2, 3]  # (1 + 1) * 2 groups
  assert dispatcher.take(10, live_version=0, timeout=0.01) == []
  dispatcher.retire([0])
  assert [r.group_id for r in dispatcher.take(10, 0, timeout=0.01)] == [4]


def test_synchronous_mode_admits_exactly_one_batch():
  dispatcher, _ = _dispatcher(max_async_level=0, groups_per_batch=3)
  assert len(dispatcher.take(10, 0, timeout=0.01)) == 3
  assert dispatcher.take(10, 0, timeout=0.01) == []


def test_groups_are_stamped_with_the_live_version_and_prompts_in_order():
  dispatcher, _ = _dispatcher()
  dispatcher.on_publish(5)
  got = dispatcher.take(2, live_version=5, timeout=0.01)
  assert [r.dispatch_version for r in got] == [5, 5]
  assert [r.prompt.prompt_id for r in got] == [0, 1]


def test_a_sampler_behind_the_newest_version_must_swap_before_taking():
  dispatcher, _ = _dispatcher()
  dispatcher.on_publish(3)
  assert dispatcher.take(2, live_version=2, timeout=0.01) == []
  assert len(dispatcher.take(2, live_version=3, timeout=0.01)) == 2


def test_publish_cancels_generating_groups_that_can_no_longer_ship():
  dispatcher, buffer = _dispatcher(max_async_level=3, k=2)
  old = dispatcher.take(2, live_version=0, timeout=0.01)
  dispatcher.on_publish(1)
  newer = dispatcher.take(2, live_version=1, timeout=0.01)
  dispatcher.finished_generating(old[1].group_id)  # finished: the buffer sweep handles it
  assert dispatcher.on_publish(2) == []
  cancelled = dispatcher.on_publish(3)  # 3 - 0 > K=2
  assert cancelled == [old[0].group_id]
  assert dispatcher.num_cancelled == 1
  assert dispatcher.in_system == 3  # cancelled groups free their capacity
  assert dispatcher.on_publish(4) == [r.group_id for r in newer]
