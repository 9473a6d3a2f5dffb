"""Admission control (the AReaL capacity rule) and cancellation."""

import itertools

import pytest

from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import orchestrator_config


class _Prompt:
  def __init__(self, i):
    self.prompt_id = i


def _dispatcher(max_async_level=1, groups_per_batch=2, k=2, reference="dispatch",
                requeue_dropped=0):
  cfg = orchestrator_config.OrchestratorConfig(group_size=2, batch_size=2 * groups_per_batch,
                                          max_async_level=max_async_level,
                                          max_off_policy_steps=k, staleness_reference=reference,
                                          requeue_dropped=requeue_dropped)
  buffer = buffer_lib.RolloutBuffer(cfg)
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
  assert cancelled == [old[0]]
  assert dispatcher.num_cancelled == 1
  assert dispatcher.in_system == 3  # cancelled groups free their capacity
  assert dispatcher.on_publish(4) == newer


def test_oldest_token_cancellation_counts_from_the_first_sampled_version():
  dispatcher, _ = _dispatcher(max_async_level=3, k=2, reference="oldest_token")
  queued, started_late, started = dispatcher.take(3, live_version=0, timeout=0.01)
  dispatcher.note_sampling(started.group_id, 0)
  dispatcher.note_sampling(started_late.group_id, 2)  # waited for a slot until v2
  dispatcher.note_sampling(started_late.group_id, 3)  # later tokens do not move it
  # At v3: 3 - 0 > 2 for `started`; `started_late` counts from 2; `queued` has no token.
  assert dispatcher.on_publish(3) == [started]
  assert dispatcher.on_publish(4) == []
  assert dispatcher.on_publish(5) == [started_late]
  assert dispatcher.on_publish(50) == []  # a group with no token can always still ship
  dispatcher.note_sampling(queued.group_id, 50)
  assert dispatcher.on_publish(53) == [queued]


def test_dropped_prompts_are_requeued_ahead_of_new_ones_up_to_the_limit():
  dispatcher, _ = _dispatcher(max_async_level=0, groups_per_batch=2, requeue_dropped=1)
  first = dispatcher.take(2, live_version=0, timeout=0.01)
  dispatcher.retire([first[0].group_id], dropped=True)  # stale: requeued
  dispatcher.retire([first[1].group_id])  # trained: not requeued
  again = dispatcher.take(2, live_version=0, timeout=0.01)
  assert [r.prompt.prompt_id for r in again] == [first[0].prompt.prompt_id, 2]
  assert [r.attempt for r in again] == [1, 0]
  assert again[0].group_id not in (first[0].group_id, first[1].group_id)
  dispatcher.retire([r.group_id for r in again], dropped=True)
  # The requeued prompt used its one requeue; the new one is requeued.
  third = dispatcher.take(2, live_version=0, timeout=0.01)
  assert [r.prompt.prompt_id for r in third] == [2, 3]
  assert dispatcher.num_requeued == 2


def test_a_finite_stream_ends_dispatch_and_drains():
  cfg = orchestrator_config.OrchestratorConfig(group_size=2, batch_size=8, requeue_dropped=1)
  buffer = buffer_lib.RolloutBuffer(cfg)
  dispatcher = dispatcher_lib.Dispatcher(cfg, iter([_Prompt(0), _Prompt(1), _Prompt(2)]),
                                         lambda p: [1], buffer)
  got = dispatcher.take(10, live_version=0, timeout=0.01)
  assert [r.prompt.prompt_id for r in got] == [0, 1, 2] and dispatcher.exhausted
  assert not dispatcher.drained  # three groups in flight
  dispatcher.finished_generating(0)
  dispatcher.finished_generating(1)
  dispatcher.retire([2], dropped=True)  # requeued: still something to dispatch
  assert not dispatcher.drained
  (again,) = dispatcher.take(10, live_version=0, timeout=0.01)
  assert again.prompt.prompt_id == 2 and again.attempt == 1
  dispatcher.finished_generating(again.group_id)
  assert dispatcher.drained


def test_a_prompt_budget_rides_on_its_request_and_must_be_positive():
  cfg = orchestrator_config.OrchestratorConfig(group_size=2, batch_size=8)
  buffer = buffer_lib.RolloutBuffer(cfg)
  budgets = {0: 5, 1: None, 2: 0}
  dispatcher = dispatcher_lib.Dispatcher(cfg, (_Prompt(i) for i in itertools.count()),
                                         lambda p: [1], buffer,
                                         budget_fn=lambda p: budgets[p.prompt_id])
  first, second = dispatcher.take(2, 0, timeout=0.01)
  assert (first.max_new_tokens, first.budget(8), first.budget(3)) == (5, 5, 3)
  assert (second.max_new_tokens, second.budget(8)) == (None, 8)
  with pytest.raises(ValueError, match="prompt 2: completion budget 0 is < 1"):
    dispatcher.take(1, 0, timeout=0.01)



def test_reassigned_groups_go_out_first_with_their_ids_and_dispatch_versions():
  dispatcher, _ = _dispatcher(max_async_level=0, groups_per_batch=2)
  first = dispatcher.take(10, live_version=0, timeout=0.01)
  assert [r.group_id for r in first] == [0, 1]
  dispatcher.finished_generating(0)  # group 0 is done; only 1 can be reassigned
  dispatcher.on_publish(1)
  assert dispatcher.reassign([0, 1, 7]) == [1]
  assert dispatcher.reassign([1]) == []  # already waiting to go out again
  # At capacity, yet the reassigned group goes out (it holds its capacity).
  again = dispatcher.take(10, live_version=1, timeout=0.01)
  assert [(r.group_id, r.dispatch_version, r.prompt.prompt_id) for r in again] == [(1, 0, 1)]
  assert dispatcher.num_reassigned == 1 and dispatcher.in_system == 2
  assert dispatcher.take(10, live_version=1, timeout=0.01) == []


def test_a_reassigned_group_cancelled_while_waiting_is_not_handed_out():
  dispatcher, _ = _dispatcher(max_async_level=3, k=1)
  dispatcher.take(1, live_version=0, timeout=0.01)
  dispatcher.reassign([0])
  assert [r.group_id for r in dispatcher.on_publish(2)] == [0]  # lag 2 > K
  assert [r.group_id for r in dispatcher.take(1, live_version=2, timeout=0.01)] == [1]
