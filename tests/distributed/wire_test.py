"""The binary wire format: messages round-trip bit for bit, and every way a
peer can damage a message is a ValueError that names it."""

import json

import numpy as np
import pytest

from arl_jax.core import rollout as rollout_lib
from arl_jax.distributed import wire


def _group(rng, lengths=((3, 5), (3, 0), (3, 9))):
  rollouts = [rollout_lib.Rollout(
      group_id=7, sample_index=i, prompt_ids=rng.integers(0, 300, p).astype(np.int32),
      completion_ids=rng.integers(0, 300, c).astype(np.int32),
      loss_mask=(np.arange(c) % 3 > 0).astype(np.float32),  # observation tokens between
      behaviour_logprobs=-rng.exponential(size=c).astype(np.float32),
      token_versions=np.where(np.arange(c) % 3 > 0, rng.integers(0, 4, c), -1).astype(np.int32),
      dispatch_version=2,
      finish_reason="stop" if c else "length", reward=float(i), env_name="arith",
      timings={"tool_s": 0.25 * i}, reward_parts={"fraction_passed": i / 4} if i else {},
      outcome="passed" if i else "") for i, (p, c) in enumerate(lengths)]
  return rollout_lib.Group(group_id=7, prompt_id=11, dispatch_version=2, rollouts=rollouts)


def _round_trip(message):
  return wire.decode([bytes(f) for f in wire.encode(message)])


def test_a_group_arrives_bit_for_bit():
  group = _group(np.random.default_rng(0))
  group.rollouts[0].behaviour_logprobs[:3] = [-0.0, -1e-45, -3.4e38]  # sign, subnormal, huge
  got = wire.group_from_wire(_round_trip({"type": "group",
                                          "group": wire.group_to_wire(group)})["group"])
  assert (got.group_id, got.prompt_id, got.dispatch_version) == (7, 11, 2)
  for want, have in zip(group.rollouts, got.rollouts, strict=True):
    for field in ("prompt_ids", "completion_ids", "loss_mask", "behaviour_logprobs",
                  "token_versions"):
      a, b = getattr(want, field), getattr(have, field)
      assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), field
      assert not b.flags.writeable  # a view of the frame: nothing may change a sample
    for field in ("sample_index", "finish_reason", "reward", "env_name", "timings",
                  "reward_parts", "outcome"):
      assert getattr(want, field) == getattr(have, field), field


def test_arrays_travel_as_raw_frames_beside_a_small_header():
  tokens = np.arange(8192, dtype=np.int32)
  frames = wire.encode({"type": "x", "nested": [{"tokens": tokens}], "empty": np.zeros(0)})
  assert len(frames) == 3 and len(frames[0]) < 200
  assert bytes(frames[1]) == tokens.astype("<i4").tobytes()
  message = _round_trip({"type": "x", "nested": [{"tokens": tokens}], "n": 3,
                         "grid": np.ones((2, 3), np.float64), "empty": np.zeros(0)})
  np.testing.assert_array_equal(message["nested"][0]["tokens"], tokens)
  assert message["grid"].shape == (2, 3) and message["empty"].shape == (0,)
  assert message["n"] == 3
  big_endian = np.arange(4, dtype=">i4")
  np.testing.assert_array_equal(_round_trip({"type": "x", "a": big_endian})["a"], big_endian)


def test_what_cannot_be_sent_is_refused_at_the_sender():
  with pytest.raises(TypeError, match="cannot send a object array"):
    wire.encode({"type": "x", "a": np.array([{}], dtype=object)})


def _frames():
  return [bytes(f) for f in wire.encode({"type": "x", "a": np.arange(4, dtype=np.int32)})]


def _with_header(**changes):
  frames = _frames()
  header = json.loads(frames[0])
  for key, value in changes.items():
    if key == "ref":
      header["a"].update(value)
    else:
      header[key] = value
  return [json.dumps(header).encode(), *frames[1:]]


@pytest.mark.parametrize("frames, error", [
    ([], "an empty message"),
    ([b"\xff"], "not a fleet message header"),
    ([b"[1, 2]"], "not a fleet message"),
    (_with_header(v=wire.WIRE_VERSION + 1),
     f"wire version {wire.WIRE_VERSION + 1}, this process speaks {wire.WIRE_VERSION}"),
    (_frames()[:1], r"array reference 0 with 0 array frames"),
    (_frames() + [b"1234"], "2 array frames, the header refers to 1"),
    ([_frames()[0], _frames()[1][:-1]], r"holds 15 bytes, \[4\] <i4 needs 16 \(truncated\?\)"),
    (_with_header(ref={"dtype": "|O"}), "array dtype '|O' not sendable"),
    (_with_header(ref={"shape": [-4]}), r"array shape \[-4\]"),
    (_with_header(ref={"__frame__": "0"}), "array reference '0'"),
    (_with_header(ref={"__frame__": True}), "array reference True"),
    (_with_header(ref={"dtype": [1]}), r"array dtype \[1\] not sendable"),
    ([b"[" * 100_000 + b"]" * 100_000], "not a fleet message header"),
])
def test_every_damage_is_a_named_value_error(frames, error):
  with pytest.raises(ValueError, match=error):
    wire.decode(frames)


def test_a_group_with_inconsistent_arrays_is_refused():
  record = _round_trip({"type": "group", "group": wire.group_to_wire(
      _group(np.random.default_rng(1)))})["group"]
  record["rollouts"][0]["logprobs"] = record["rollouts"][0]["logprobs"][:-1]
  with pytest.raises(ValueError, match="Rollout.behaviour_logprobs has length 4, completion has 5"):
    wire.group_from_wire(record)
  record["rollouts"][0]["logprobs"] = record["rollouts"][0]["loss_mask"].astype(np.float64)
  with pytest.raises(ValueError, match="rollout 0: logprobs must be a 1-D float32 array"):
    wire.group_from_wire(record)


@pytest.mark.parametrize("field, value, error", [
    ("timings", [1.0], "rollout.timings has the wrong type"),
    ("reward", [1.0], "rollout.reward has the wrong type"),
    ("sample_index", None, "rollout.sample_index has the wrong type"),
])
def test_a_rollout_record_of_the_wrong_types_is_refused(field, value, error):
  record = _round_trip({"type": "group", "group": wire.group_to_wire(
      _group(np.random.default_rng(2)))})["group"]
  record["rollouts"][1][field] = value
  with pytest.raises(ValueError, match=error):
    wire.group_from_wire(record)
  record["rollouts"] = np.arange(3, dtype=np.int32)
  with pytest.raises(ValueError, match="group.rollouts has the wrong type"):
    wire.group_from_wire(record)


def test_a_held_group_carries_its_metadata_only():
  group = _group(np.random.default_rng(0))
  record = wire.group_to_wire(group, held_by=3, copy=5)
  message = _round_trip({"type": "group", "group": record})
  assert len(wire.encode({"type": "group", "group": record})) == 1  # no array frames
  got = wire.group_from_wire(message["group"])
  assert got.holder == 3 and got.oldest_version == group.oldest_version
  assert {r.copy for r in got.rollouts} == {5}
  for want, have in zip(group.rollouts, got.rollouts, strict=True):
    assert isinstance(have, rollout_lib.HeldRollout)
    assert (have.prompt_length, have.completion_length) == (want.prompt_length,
                                                           want.completion_length)
    assert have.version_span == want.version_span and have.reward == want.reward
  bad = json.loads(json.dumps(record))
  bad["rollouts"][0]["span"] = [5, 1]
  with pytest.raises(ValueError, match="inconsistent"):
    wire.group_from_wire(bad)
  bad["rollouts"][0]["span"] = ["a", 1]
  with pytest.raises(ValueError, match="span must be two versions"):
    wire.group_from_wire(bad)
