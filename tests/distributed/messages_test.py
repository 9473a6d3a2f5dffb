"""Typed learner/sampler messages: each round-trips through the wire as it
was, and anything a peer could get wrong is a ValueError naming it."""

import pytest

from arl_jax.distributed import messages, wire

ENV = {"errors": {"tool": 1}, "timeouts": {}, "turns": 3}

EXAMPLES = [
    messages.Hello(name="s0", devices=2), messages.Hello(name="s1", devices=1, process=1),
    messages.Take(n=4, version=2, notes=[[7, 2]]), messages.GroupDone(group={"group_id": 5}),
    messages.Heartbeat(stats={"sampled_tokens": 10}, env=ENV), messages.Bye(stats={}, env=ENV),
    messages.Welcome(sampler_id=0, spec={"x": 1}, sampler_mesh=[["data", 1]],
                     weights_address="tcp://h:1", heartbeat_s=0.5, timeout_s=20),
    messages.Refused(reason="too few devices"), messages.Rejected(reason="lost"),
    messages.Groups(requests=[{"group_id": 1}]), messages.Cancel(group_ids=[1, 2]),
    messages.Ack(), messages.Lockstep(step=3), messages.Stop(),
]


def _round_trip(message, allowed=None):
  allowed = allowed or (messages.FROM_SAMPLER + messages.FROM_LEARNER)
  return messages.from_frames([bytes(f) for f in wire.encode(messages.to_wire(message))],
                              allowed)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
  got = _round_trip(message)
  assert type(got) is type(message) and got == message


def test_every_kind_is_one_class_in_one_direction():
  assert set(messages.KINDS.values()) == set(messages.FROM_SAMPLER + messages.FROM_LEARNER)
  assert not set(messages.FROM_SAMPLER) & set(messages.FROM_LEARNER)


@pytest.mark.parametrize("record, problem", [
    ({"type": "gossip"}, "unknown message type 'gossip'"),
    ({"type": "welcome", "sampler_id": 0}, "unknown message type 'welcome'"),  # (wrong way)
    ({"type": "take", "n": 1}, "'take' without 'version'"),
    ({"type": "take", "n": True, "version": 0}, r"take.n has the wrong type \(bool\)"),
    ({"type": "take", "n": 1, "version": 0, "extra": 1}, r"unknown field\(s\) \['extra'\]"),
    ({"type": "take", "n": 1, "version": 0, "notes": [[1]]}, "pairs"),
    ({"type": "take", "n": 1, "version": 0, "notes": [[1, "2"]]}, "take.notes"),
    ({"type": "group", "group": {"group_id": "7"}}, "group.group_id has the wrong type"),
    ({"type": "heartbeat", "stats": {"steps": "x"}, "env": ENV}, "stats.steps"),
    ({"type": "heartbeat", "stats": {}, "env": {**ENV, "errors": {"x": 1.5}}},
     "not integers"),
    ({"type": "hello", "name": "s", "devices": 1, "process": "0"}, "hello.process"),
])
def test_what_a_peer_gets_wrong_is_named(record, problem):
  with pytest.raises(ValueError, match=problem):
    messages.from_wire(record, messages.FROM_SAMPLER)
