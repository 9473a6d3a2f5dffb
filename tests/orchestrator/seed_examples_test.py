"""The seed document's examples, replayed event by event through the
orchestrator with a scripted sampler and a fake clock, under both staleness
references."""

import itertools
import threading

import numpy as np
import pytest

from arl_jax.core import rollout as rollout_lib
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.orchestrator import orchestrator_config
from arl_jax.testing import fake_sampler


class _Prompt:
  def __init__(self, i):
    self.prompt_id = i


class Script:
  """Drives an Orchestrator by hand: dispatch, sample, finish, cut, publish."""

  def __init__(self, k, reference, assembly="first_done"):
    self.clock = fake_sampler.FakeClock()
    self.orch = orchestrator_lib.Orchestrator(
        orchestrator_config.OrchestratorConfig(
            group_size=2, batch_size=2, max_async_level=8, max_off_policy_steps=k,
            staleness_reference=reference, assembly=assembly),
        prompts=(_Prompt(i) for i in itertools.count()), encode_fn=lambda p: [1],
        env_name_of=lambda prompt: "seed", max_new_tokens=128, clock=self.clock)
    self.version = 0

  def at(self, seconds):
    self.clock.now = seconds
    return self

  def publish(self, version, trained=()):
    self.version = version
    return self.orch.publish(version, trained=list(trained))

  def dispatch(self, first_token_version=None):
    (request,) = self.orch.dispatcher.take(1, self.version, timeout=0.0)
    if first_token_version is None:
      first_token_version = request.dispatch_version
    self.orch.dispatcher.note_sampling(request.group_id, first_token_version)
    return request

  def finish(self, request, token_versions):
    rollouts = [rollout_lib.Rollout(
        group_id=request.group_id, sample_index=s, prompt_ids=np.array([1], np.int32),
        completion_ids=np.ones(len(token_versions), np.int32),
        loss_mask=np.ones(len(token_versions), np.float32),
        behaviour_logprobs=np.full(len(token_versions), -0.5, np.float32),
        token_versions=np.asarray(token_versions, np.int32),
        dispatch_version=request.dispatch_version, finish_reason="stop", reward=float(s),
        env_name="seed") for s in range(2)]
    group = rollout_lib.Group(group_id=request.group_id, prompt_id=request.prompt.prompt_id,
                              dispatch_version=request.dispatch_version, rollouts=rollouts)
    self.orch.group_finished(group)
    return group

  def cut(self):
    return self.orch.try_cut(self.version)


# The coding rollout: 3,000 tokens under pi_9, 4,500 under pi_10, the rest under
# pi_11 (scaled down 100x).
CODING = [9] * 30 + [10] * 45 + [11] * 20


@pytest.mark.parametrize("reference", ["dispatch", "oldest_token"])
@pytest.mark.parametrize("k", [2, 4])
def test_seed_worked_example(k, reference):
  s = Script(k, reference)
  s.publish(9)
  filler, coding, math = s.dispatch(), s.dispatch(), s.dispatch()  # inference serves pi_9
  s.at(1).finish(filler, [9, 9])
  b9 = s.cut()
  assert [g.group_id for g in b9.groups] == [filler.group_id]
  assert s.at(2).publish(10, b9.groups) == []
  filler2 = s.dispatch()
  # The math rollout finishes in 40 s under pi_9 and trains in B_10 with lag 1.
  s.at(40).finish(math, [9] * 12)
  b10 = s.cut()
  assert [g.group_id for g in b10.groups] == [math.group_id]
  assert b10.lag_metrics()["lag_max"] == 1
  assert s.at(41).publish(11, b10.groups) == []  # 11 - 9 = 2 <= K: the coding group goes on
  s.at(45).finish(filler2, [10, 11])
  b11 = s.cut()
  assert [g.group_id for g in b11.groups] == [filler2.group_id]
  # 25 minutes in, the coding rollout finishes with span (9, 11) while B_11
  # trains, so the first batch it can join is B_12.
  group = s.at(1500).finish(coding, CODING)
  assert group.rollouts[0].version_span == (9, 11)
  assert s.at(1600).publish(12, b11.groups) == []  # in the buffer now, not in flight
  b12 = s.cut()
  if k == 2:  # lag 12 - 9 = 3 > K: swept right before B_12 is cut
    assert b12 is None
    assert s.orch.ledger.dropped["stale"] == 2  # both rollouts of the group
    assert s.orch.dispatcher.in_system == 0  # its admission capacity is freed at once
  else:  # K=4: it trains, each token against the probability it was sampled with
    assert [g.group_id for g in b12.groups] == [coding.group_id]
    lags = b12.lag_metrics()
    assert lags["lag_max"] == 3
    # Lag 3 = 2 versions while in flight (9 -> 11 on arrival) + 1 in the buffer.
    assert lags["lag_in_flight_mean"] == 2 and lags["lag_in_queue_mean"] == 1
    np.testing.assert_array_equal(b12.groups[0].rollouts[0].token_versions, CODING)
    assert s.orch.ledger.dropped["stale"] == 0


@pytest.mark.parametrize("reference", ["dispatch", "oldest_token"])
@pytest.mark.parametrize("batch_version", [18, 19])
def test_seed_closing_example_in_the_buffer(reference, batch_version):
  """K=8: a group dispatched at 10 can still be in the batch that updates 18
  into 19; the batch that produces version 20 (B_19) drops it."""
  s = Script(8, reference)
  s.publish(10)
  group = s.dispatch()
  s.at(1).finish(group, [10, 10, 11])
  for v in range(11, batch_version + 1):
    assert s.at(v).publish(v) == []
  result = s.cut()
  if batch_version == 18:
    assert [g.group_id for g in result.groups] == [group.group_id]
    assert result.lag_metrics()["lag_max"] == 8
  else:
    assert result is None and s.orch.ledger.dropped["stale"] == 2


@pytest.mark.parametrize("reference", ["dispatch", "oldest_token"])
def test_seed_closing_example_in_flight_is_cancelled_when_19_is_published(reference):
  s = Script(8, reference)
  s.publish(10)
  group = s.dispatch()
  for v in range(11, 19):
    assert s.at(v).publish(v) == []
  assert s.orch.dispatcher.in_system == 1  # at 18 it can still ship (lag 8 in B_18)
  assert s.at(19).publish(19) == [group.group_id]  # lag in B_19 would be 9 > 8
  assert s.orch.ledger.dropped["cancelled"] == 2
  # A late finish is ignored: nothing of it reaches a batch.
  s.at(20).finish(group, [10, 19])
  assert s.cut() is None and len(s.orch.buffer) == 0


def test_oldest_token_counts_in_flight_lag_from_the_first_sampled_token():
  """Dispatched at 10 but first sampled at 12 (it waited for a slot): under
  `oldest_token` it may train up to B_20, so it is cancelled only at 21."""
  cancelled_at = {}
  for reference in ("dispatch", "oldest_token"):
    s = Script(8, reference)
    s.publish(10)
    group = s.dispatch(first_token_version=12)
    for v in range(11, 30):
      if s.at(v).publish(v) == [group.group_id]:
        cancelled_at[reference] = v
        break
  assert cancelled_at == {"dispatch": 19, "oldest_token": 21}


def test_blocking_cut_waits_reports_every_swept_group_and_unblocks_on_close():
  s = Script(1, "dispatch", assembly="fifo")
  old = s.dispatch()
  s.finish(old, [0, 0])
  s.publish(2)
  fresh = s.dispatch()
  # B_2 needs `fresh` (fifo); the attempt sweeps `old` (lag 2 > 1) and times out.
  with pytest.raises(TimeoutError):
    s.orch.cut(2, timeout=0.05)
  assert s.orch.ledger.dropped["stale"] == 2
  threading.Timer(0.1, lambda: s.finish(fresh, [2, 2])).start()
  batch = s.orch.cut(2, timeout=5)
  assert [g.group_id for g in batch.groups] == [fresh.group_id]
  # The batch reports the group swept by the earlier, failed attempt.
  assert [g.group_id for g in batch.stale] == [old.group_id]
  threading.Timer(0.1, s.orch.close).start()
  with pytest.raises(buffer_lib.BufferClosed):
    s.orch.cut(3, timeout=5)


def test_arrival_is_never_before_the_newest_version_that_sampled_the_group():
  """The sampler can swap to a version before the orchestrator announces it."""
  s = Script(8, "dispatch")
  request = s.dispatch()
  group = s.finish(request, [0, 1])  # version 1 sampled; publish(1) not yet seen
  assert group.arrival_version == 1
  s.publish(1)
  lags = s.cut().lag_metrics()
  assert lags["lag_in_flight_mean"] == 1 and lags["lag_in_queue_mean"] == 0
