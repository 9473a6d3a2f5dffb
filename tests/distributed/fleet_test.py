"""The learner's sampler fleet, spoken to by fake samplers over the real protocol:
ownership, loss detection and reassignment, late and malformed groups."""

import itertools
import time

import numpy as np
import pytest
import zmq

from arl_jax.core import rollout as rollout_lib
from arl_jax.distributed import fleet as fleet_lib
from arl_jax.distributed import fleet_config, wire
from arl_jax.envs import env_api
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.orchestrator import orchestrator_config

_G = 2


class _NoWeights:
  def latest(self):
    return None, None


def _orchestrator(groups_per_batch=2):
  k = 8
  prompts = (env_api.TextPrompt(prompt_id=i, text=f"p{i}", answer="a")
             for i in itertools.count())
  return orchestrator_lib.Orchestrator(
      orchestrator_config.OrchestratorConfig(
          group_size=_G, batch_size=_G * groups_per_batch, max_async_level=1,
          max_off_policy_steps=k),
      prompts=prompts, encode_fn=lambda p: [5, p.prompt_id + 1], env_name_of=lambda p: "t",
      max_new_tokens=8)


class _FakeSampler:
  """A DEALER socket speaking the sampler side of the protocol by hand."""

  def __init__(self, address, devices=4, process=None):
    self.socket = zmq.Context.instance().socket(zmq.DEALER)
    self.socket.linger = 0
    self.socket.connect(address)
    hello = {"type": "hello", "name": "fake", "devices": devices}
    if process is not None:  # a multi-controller process's sampler
      hello["process"] = process
    self.welcome = self.ask(hello)

  def send(self, message):
    self.socket.send_multipart(wire.encode(message))

  def ask(self, message, timeout_s=10.0):
    self.send(message)
    return self.receive(timeout_s)

  def receive(self, timeout_s=10.0):
    assert self.socket.poll(int(timeout_s * 1000)), "the fleet did not answer"
    return wire.decode(self.socket.recv_multipart())

  def take(self, n, version=0):
    reply = self.ask({"type": "take", "n": n, "version": version})
    assert reply["type"] == "groups"
    return [wire.request_from_wire(r) for r in reply["requests"]]

  def deliver(self, request, reward=1.0):
    self.send(_group_message(request, reward))

  def close(self):
    self.socket.close()


def _group_message(request, reward=1.0):
  """The message a sampler sends with `request`'s finished group."""
  rollouts = [rollout_lib.Rollout(
        group_id=request.group_id, sample_index=s,
        prompt_ids=np.asarray(request.prompt_ids, np.int32),
        completion_ids=np.array([7, 8], np.int32), loss_mask=np.ones(2, np.float32),
        behaviour_logprobs=np.array([-0.5, -0.25], np.float32),
        token_versions=np.array([0, 0], np.int32), dispatch_version=request.dispatch_version,
        finish_reason="stop", reward=reward, env_name="t") for s in range(_G)]
  return {"type": "group", "group": wire.group_to_wire(rollout_lib.Group(
      group_id=request.group_id, prompt_id=request.prompt.prompt_id,
      dispatch_version=request.dispatch_version, rollouts=rollouts))}


@pytest.fixture
def fleet():
  orchestrator = _orchestrator()
  events = []
  fleet = fleet_lib.SamplerFleet(
      fleet_config.FleetConfig(remote=True, heartbeat_s=0.05, timeout_s=0.5),
      orchestrator=orchestrator, publisher=_NoWeights(), spec={"seed": 0},
      sampler_mesh_shape=[("data", 4), ("tp", 1)], print_fn=lambda line: None,
      event_fn=events.append)
  fleet.events = events
  fleet.orchestrator = orchestrator
  fleet.start()
  yield fleet
  fleet.stop()


def _wait(condition, timeout_s=5.0):
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.01)


def test_a_joining_sampler_gets_the_settings_and_its_groups_reach_the_buffer(fleet):
  sampler = _FakeSampler(fleet.address)
  assert sampler.welcome["type"] == "welcome"
  assert sampler.welcome["spec"] == {"seed": 0}  # (the resolved RunSpec, as JSON)
  assert sampler.welcome["sampler_mesh"] == [["data", 4], ["tp", 1]]
  requests = sampler.take(3)
  assert [r.group_id for r in requests] == [0, 1, 2]
  assert [r.prompt.prompt_id for r in requests] == [0, 1, 2]
  for request in requests[:2]:
    sampler.deliver(request)
  batch = fleet.orchestrator.cut(0, timeout=5.0)  # FIFO: groups 0 and 1
  assert [g.group_id for g in batch.groups] == [0, 1]
  np.testing.assert_array_equal(batch.groups[0].rollouts[1].behaviour_logprobs, [-0.5, -0.25])
  assert fleet.metrics()["fleet_groups_by_sampler"] == {"0": 2}
  sampler.close()


def test_a_sampler_with_too_few_devices_is_refused(fleet):
  sampler = _FakeSampler(fleet.address, devices=2)
  assert sampler.welcome["type"] == "refused"
  assert "mesh.sampler" in sampler.welcome["reason"]
  sampler.close()


def test_samplers_share_the_free_capacity(fleet):
  first, second = _FakeSampler(fleet.address), _FakeSampler(fleet.address)
  # Capacity 4 groups, two live samplers: a take gets at most half of what is
  # free (rounded up), whatever it asks for, so the first to ask leaves work.
  assert [r.group_id for r in first.take(4)] == [0, 1]
  assert [r.group_id for r in second.take(4)] == [2]  # 2 free: a share of 1
  assert [r.group_id for r in second.take(4)] == [3]
  assert first.take(4) == []  # nothing free
  first.close()
  second.close()


def test_a_silent_sampler_is_lost_and_its_groups_go_to_another(fleet):
  quiet, busy = _FakeSampler(fleet.address), _FakeSampler(fleet.address)
  held = quiet.take(2)
  other = busy.take(1)  # capacity is 4 groups: 2 held by `quiet`, 1 here
  assert [r.group_id for r in held] == [0, 1] and [r.group_id for r in other] == [2]

  def heartbeat():  # `busy` stays alive; `quiet` says nothing more
    reply = busy.ask({"type": "heartbeat", "stats": {}, "env": {
        "errors": {}, "timeouts": {}, "turns": 0}})
    assert reply["type"] == "ack"
    return any(e["event"] == "sampler_lost" for e in fleet.events)

  _wait(heartbeat)
  lost = [e for e in fleet.events if e["event"] == "sampler_lost"]
  assert lost == [{"event": "sampler_lost", "sampler": 0, "reason": "no message for 0.5s",
                   "reassigned": [0, 1]}]
  again = busy.take(4)
  # The lost groups first, same ids, prompts and dispatch versions; then a new one.
  assert [(r.group_id, r.prompt.prompt_id, r.dispatch_version) for r in again] == [
      (0, 0, 0), (1, 1, 0), (3, 3, 0)]
  # The lost sampler wakes up: its late group is refused and never trained.
  quiet.deliver(held[0], reward=-5.0)
  assert quiet.receive()["type"] == "rejected"
  for request in again[:2]:
    busy.deliver(request)
  batch = fleet.orchestrator.cut(0, timeout=5.0)
  assert [g.group_id for g in batch.groups] == [0, 1]
  assert all(r.reward == 1.0 for g in batch.groups for r in g.rollouts)
  metrics = fleet.metrics()
  assert metrics["fleet_samplers_lost"] == 1 and metrics["fleet_groups_reassigned"] == 2
  assert metrics["fleet_samplers_live"] == 1
  quiet.close()
  busy.close()


def test_cancellations_reach_the_owner_and_its_late_group_is_ignored(fleet):
  sampler = _FakeSampler(fleet.address)
  requests = sampler.take(2)
  fleet.cancel([requests[1].group_id])
  message = sampler.receive()
  assert message == {"type": "cancel", "group_ids": [1]}
  sampler.deliver(requests[1])
  sampler.deliver(requests[0])
  _wait(lambda: fleet.metrics()["fleet_groups_by_sampler"] == {"0": 1})
  assert fleet.late_groups == 1
  sampler.close()


def test_a_malformed_group_is_generated_again(fleet):
  sampler = _FakeSampler(fleet.address)
  (request,) = sampler.take(1)
  record = {"group_id": request.group_id, "prompt_id": 0, "dispatch_version": 0,
            "rollouts": []}  # no rollouts
  sampler.send({"type": "group", "group": record})
  _wait(lambda: fleet.bad_groups == 1)
  assert [r.group_id for r in sampler.take(1)] == [request.group_id]
  sampler.close()


def test_a_sampler_breaking_the_protocol_is_dropped_and_the_run_goes_on(fleet):
  bad, good = _FakeSampler(fleet.address), _FakeSampler(fleet.address)
  held = bad.take(2)
  reply = bad.ask({"type": "gossip"})
  assert reply["type"] == "rejected" and "malformed message" in reply["reason"]
  assert [e["reassigned"] for e in fleet.events if e["event"] == "sampler_lost"] == [
      [r.group_id for r in held]]
  assert [r.group_id for r in good.take(2)] == [r.group_id for r in held]
  assert not fleet.failed
  bad.close()
  good.close()


@pytest.mark.parametrize("damage", ["truncated_array", "missing_frame", "other_version",
                                    "not_json"])
def test_a_damaged_frame_drops_that_sampler_not_the_run(fleet, damage):
  bad, good = _FakeSampler(fleet.address), _FakeSampler(fleet.address)
  (request,) = bad.take(1)
  frames = [bytes(f) for f in wire.encode(_group_message(request))]
  if damage == "truncated_array":
    frames[3] = frames[3][:-2]
  elif damage == "missing_frame":
    frames.pop()
  elif damage == "other_version":
    frames[0] = frames[0].replace(b'"v":%d' % wire.WIRE_VERSION, b'"v":99')
  else:
    frames[0] = b"\xff" + frames[0]
  bad.socket.send_multipart(frames)
  reply = bad.receive()
  assert reply["type"] == "rejected" and "malformed message" in reply["reason"], reply
  assert [r.group_id for r in good.take(1)] == [request.group_id]  # generated again
  good.deliver(request)
  _wait(lambda: fleet.metrics()["fleet_groups_by_sampler"] == {"0": 0, "1": 1})
  assert not fleet.failed and fleet.bad_groups == 0
  bad.close()
  good.close()


def test_counters_add_what_each_sampler_reports_since_its_last_report(fleet):
  a, b = _FakeSampler(fleet.address), _FakeSampler(fleet.address)
  for sampler, tokens, errors in ((a, 10, 1), (b, 5, 0), (a, 30, 2)):
    reply = sampler.ask({"type": "heartbeat", "stats": {"sampled_tokens": tokens},
                         "env": {"errors": {"t": errors}, "timeouts": {}, "turns": tokens}})
    assert reply["type"] == "ack"
  assert fleet.stats.sampled_tokens == 35 and fleet.turns == 35
  assert fleet.errors == {"t": 2}
  a.close()
  b.close()


def test_fleet_config_checks():
  with pytest.raises(ValueError, match="timeout_s=1.0 must be >= 4 x heartbeat_s=0.5"):
    fleet_config.FleetConfig(heartbeat_s=0.5, timeout_s=1.0)


@pytest.mark.parametrize("message", [
    {"type": "take", "n": [1, 2], "version": 0},
    {"type": "take", "n": 1, "version": 0, "notes": [[1]]},
    {"type": "group", "group": np.arange(4, dtype=np.int32)},
    {"type": "group", "group": {"group_id": "7"}},
    {"type": "heartbeat", "stats": {"steps": "x"}, "env": {"errors": {}, "timeouts": {},
                                                          "turns": 0}},
    {"type": "heartbeat", "stats": {}, "env": {"errors": {"x": 1.5}, "timeouts": {},
                                                "turns": 0}},
    {"type": "take", "n": {"__frame__": 0, "dtype": [1], "shape": [1]}, "version": 0},
])
def test_a_message_of_the_wrong_shape_drops_that_sampler_not_the_run(fleet, message):
  bad = _FakeSampler(fleet.address)
  frames = [bytes(f) for f in wire.encode(message)]
  if "__frame__" in str(message):  # a hand-made array reference, and its frame
    frames.append(b"\0" * 4)
  bad.socket.send_multipart(frames)
  reply = bad.receive()
  assert reply["type"] == "rejected" and "malformed message" in reply["reason"], reply
  assert not fleet.failed
  bad.close()


def test_a_group_whose_rollouts_are_not_records_is_generated_again(fleet):
  sampler = _FakeSampler(fleet.address)
  (request,) = sampler.take(1)
  message = _group_message(request)
  message["group"]["rollouts"] = np.arange(2, dtype=np.int32)  # an array where a list belongs
  sampler.send(message)
  _wait(lambda: fleet.bad_groups == 1)
  assert [r.group_id for r in sampler.take(1)] == [request.group_id]
  assert not fleet.failed
  sampler.close()


def test_a_held_group_arrives_as_metadata_and_a_late_one_is_forgotten(fleet):
  """A multi-controller process sends only a group's metadata; one that came
  after its cancellation, or that claims a holder other than its sender, is
  passed on to be forgotten by its holder (`ShardPlan.forget`), by copy; and
  so is an accepted one once it leaves the run's open work."""
  fleet._num_processes = 3  # noqa: SLF001 - as in a 3-process run
  sampler = _FakeSampler(fleet.address, process=1)
  requests = sampler.take(4)

  def held(request, holder=1, copy=7, **changes):
    group = wire.group_from_wire(_group_message(request)["group"])
    record = wire.group_to_wire(group, held_by=holder, copy=copy)
    for r in record["rollouts"]:
      r.update(changes)
    return {"type": "group", "group": record}

  fleet.cancel([requests[1].group_id])
  assert sampler.receive()["type"] == "cancel"
  sampler.send(held(requests[1], copy=8))  # late
  sampler.send(held(requests[2], holder=2))  # another process's, sent by process 1
  sampler.send(held(requests[3], sample_index=0))  # two rollouts of index 0
  sampler.send(held(requests[0], copy=9))
  _wait(lambda: fleet.metrics()["fleet_groups_by_sampler"] == {"0": 1}
        and fleet.bad_groups == 2)
  assert sorted(fleet.take_forgotten(lambda gid: True)) == [(1, 8), (3, 7)]
  # In the open work (a checkpoint's): metadata, the arrays to be collected.
  (saved,) = [g.to_json() for g in fleet.orchestrator.work.snapshot({}) if g.group_id == 0]
  assert [e["stage"] for e in saved["episodes"]] == ["done"] * _G
  assert all(e["held_by"] == 1 and e["completion_length"] == 2 and "completion_ids" not in e
             for e in saved["episodes"])
  assert fleet.take_forgotten(lambda gid: True) == []
  assert fleet.take_forgotten(lambda gid: gid != 0) == [(0, 9)]  # it left the open work
  assert fleet.take_forgotten(lambda gid: False) == []
  sampler.close()


def test_a_sampler_process_cannot_send_held_groups(fleet):
  sampler = _FakeSampler(fleet.address)  # not a multi-controller process
  (request,) = sampler.take(1)
  group = wire.group_from_wire(_group_message(request)["group"])
  sampler.send({"type": "group", "group": wire.group_to_wire(group, held_by=1)})
  _wait(lambda: fleet.bad_groups == 1)
  assert fleet.take_forgotten(lambda gid: True) == []
  sampler.close()
