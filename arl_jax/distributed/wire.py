"""What crosses the wire between the learner and its sampler processes.

A message is a dict of JSON metadata whose numpy arrays travel as raw
little-endian buffers: `encode` turns it into ZeroMQ multipart frames, a
small versioned JSON header (the message with each array replaced by a
reference `{"__frame__": i, "dtype": ..., "shape": [...]}`) followed by one
frame per array, its bytes as they lie in memory. No per-float text and no
pickle: a sampler process must never be able to make the learner run code,
and a float32 log-prob arrives bit for bit as it was sampled. The header
stays readable when debugging a fleet.

`decode` checks everything a peer could get wrong (the version, the header,
the number of frames, each array's dtype and byte count) and raises
ValueError naming it; the fleet then drops that peer, not the run.

A finished group is one message: the header holds each rollout's scalars,
and its five per-token arrays (ids, mask, log-probs, versions) are frames,
sent from the rollout's memory and received as read-only views of the frames
(`group_to_wire`, `group_from_wire`): the only copies are the socket's.
Before this format the same records went as JSON text
(`benchmarks/data_plane.py` keeps that codec as its comparison row).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np

from arl_jax.core import group_request as group_request_lib
from arl_jax.core import rollout as rollout_lib
from arl_jax.envs import prompt_codec
from arl_jax.sampler import engine_stats

# Bumped whenever a message's layout changes; peers of another version are refused.
WIRE_VERSION = 2  # 2: typed messages (distributed/messages.py), Stop, strict fields

# The array types a message may carry, little-endian whatever the host.
_DTYPES = {np.dtype(t).newbyteorder("<").str: np.dtype(t).newbyteorder("<")
           for t in (np.int32, np.int64, np.float32, np.float64, np.uint8, np.bool_)}

_REF = "__frame__"


def encode(message: dict) -> list:
  """The frames of `message` (a dict with a `type`; numpy arrays anywhere in
  it): `[header, array 0, array 1, ...]`. Array frames are the arrays' own
  buffers when already contiguous and little-endian (no copy)."""
  arrays = []

  def strip(value):
    if isinstance(value, np.ndarray):
      array = value
      if array.dtype.str not in _DTYPES or not array.flags.c_contiguous:  # (else as it is)
        array = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
      if array.dtype.str not in _DTYPES:
        raise TypeError(f"cannot send a {array.dtype} array (sendable: {sorted(_DTYPES)})")
      arrays.append(array)
      return {_REF: len(arrays) - 1, "dtype": array.dtype.str, "shape": list(array.shape)}
    if isinstance(value, dict):
      return {k: strip(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [strip(v) for v in value]
    return value

  header = {"v": WIRE_VERSION, **strip(message)}
  return [json.dumps(header, separators=(",", ":")).encode(),
          *(memoryview(a).cast("B") if a.size else b"" for a in arrays)]


def decode(frames: list) -> dict:
  """The message of `encode`'s frames; ValueError on anything malformed."""
  if not frames:
    raise ValueError("an empty message")
  try:
    header = json.loads(bytes(frames[0]))
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise ValueError(f"not a fleet message header ({e}): {bytes(frames[0])[:200]!r}") from e
  if not isinstance(header, dict) or "type" not in header:
    raise ValueError(f"not a fleet message: {bytes(frames[0])[:200]!r}")
  version = header.pop("v", None)
  if version != WIRE_VERSION:
    raise ValueError(f"wire version {version!r}, this process speaks {WIRE_VERSION} "
                     "(run the same arl_jax on both sides)")
  buffers = frames[1:]
  used = set()

  def restore(value):
    if isinstance(value, dict) and _REF in value:
      return _array(value, buffers, used)
    if isinstance(value, dict):
      return {k: restore(v) for k, v in value.items()}
    if isinstance(value, list):
      return [restore(v) for v in value]
    return value

  message = restore(header)
  if len(used) != len(buffers):
    raise ValueError(f"{len(buffers)} array frames, the header refers to {len(used)}")
  return message


def _array(ref: dict, buffers: list, used: set) -> np.ndarray:
  index, dtype, shape = ref.get(_REF), ref.get("dtype"), ref.get("shape")
  if (not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(buffers)
      or index in used):
    raise ValueError(f"array reference {index!r} with {len(buffers)} array frames")
  if not isinstance(dtype, str) or dtype not in _DTYPES:
    raise ValueError(f"array dtype {dtype!r} not sendable")
  if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
    raise ValueError(f"array shape {shape!r}")
  buffer = buffers[index]
  want = math.prod(shape) * _DTYPES[dtype].itemsize
  if len(buffer) != want:
    raise ValueError(f"array frame {index} holds {len(buffer)} bytes, {shape} {dtype} "
                     f"needs {want} (truncated?)")
  used.add(index)
  # A read-only view of the frame: no copy (the frame lives as long as the array).
  array = np.frombuffer(buffer, dtype=_DTYPES[dtype])
  return array if len(shape) == 1 else array.reshape(shape)


def request_to_wire(request: group_request_lib.GroupRequest) -> dict:
  return {"group_id": request.group_id, "prompt": prompt_codec.to_json(request.prompt),
          "prompt_ids": np.asarray(request.prompt_ids, np.int32),
          "dispatch_version": request.dispatch_version, "group_size": request.group_size,
          "attempt": request.attempt, "max_new_tokens": request.max_new_tokens,
          "draw_id": request.draw_id}


def request_from_wire(record: dict) -> group_request_lib.GroupRequest:
  """The request as the sampler process sees it; its `dispatch_time` is this
  process's clock at arrival (the learner's clock means nothing here)."""
  return group_request_lib.GroupRequest(
      group_id=int(record["group_id"]), prompt=prompt_codec.from_json(record["prompt"]),
      prompt_ids=tuple(int(t) for t in record["prompt_ids"]),
      dispatch_version=int(record["dispatch_version"]), group_size=int(record["group_size"]),
      dispatch_time=time.monotonic(), attempt=int(record["attempt"]),
      max_new_tokens=record["max_new_tokens"], draw_id=record.get("draw_id"))


# A rollout's per-token arrays: (wire name, Rollout field, dtype).
_TOKEN_ARRAYS = (("prompt_ids", "prompt_ids", np.int32),
                 ("completion_ids", "completion_ids", np.int32),
                 ("loss_mask", "loss_mask", np.float32),
                 ("logprobs", "behaviour_logprobs", np.float32),
                 ("versions", "token_versions", np.int32))


def group_to_wire(group: rollout_lib.Group, held_by: int | None = None, copy: int = 0) -> dict:
  """The group as a message body; each rollout's arrays become frames of
  their own, sent from the arrays' memory (no concatenation). With
  `held_by` (a multi-controller process that keeps the arrays until they
  are trained), only the metadata: lengths and version spans instead of
  the arrays (`rollout.HeldRollout`), and the holder's `copy` number."""
  def arrays(r) -> dict:
    if held_by is None:
      return {name: np.asarray(getattr(r, field), dtype) for name, field, dtype in _TOKEN_ARRAYS}
    return {"prompt_length": r.prompt_length, "completion_length": r.completion_length,
            "span": list(r.version_span)}

  record = {
      "group_id": group.group_id, "prompt_id": group.prompt_id,
      "dispatch_version": group.dispatch_version,
      "rollouts": [{
          "sample_index": r.sample_index, "finish_reason": r.finish_reason,
          "reward": r.reward, "env_name": r.env_name, "timings": r.timings,
          "reward_parts": r.reward_parts, "outcome": r.outcome, **arrays(r)}
          for r in group.rollouts],
  }
  if held_by is not None:
    record.update(held_by=held_by, held_copy=copy)
  return record


def group_from_wire(record: dict) -> rollout_lib.Group:
  """Raises ValueError (from `Rollout`'s own checks, or arrays of the wrong
  type) on an inconsistent record. The rollouts' arrays are views of the
  frames, no copy: read-only, as a sampled rollout is. A record with
  `held_by` gives `HeldRollout`s."""
  check_fields(record, "group", {"group_id": int, "prompt_id": int, "dispatch_version": int,
                                   "rollouts": list})
  group_id, dispatch_version = record["group_id"], record["dispatch_version"]
  held_by = record.get("held_by")
  if held_by is not None:
    check_fields(record, "group", {"held_by": int, "held_copy": int})
  rollouts = []
  for r in record["rollouts"]:
    check_fields(r, "rollout", {"sample_index": int, "finish_reason": str,
                                 "reward": (int, float, type(None)), "env_name": str,
                                 "timings": dict, "reward_parts": dict, "outcome": str})
    common = dict(group_id=group_id, sample_index=int(r["sample_index"]),
                  dispatch_version=dispatch_version, finish_reason=r["finish_reason"],
                  reward=r["reward"], env_name=r["env_name"],
                  timings={k: float(_number(v, "timings")) for k, v in r["timings"].items()},
                  reward_parts={str(k): float(_number(v, "reward_parts"))
                                for k, v in r["reward_parts"].items()},
                  outcome=r["outcome"])
    if held_by is not None:
      check_fields(r, "rollout", {"prompt_length": int, "completion_length": int, "span": list})
      span = r["span"]
      if len(span) != 2 or not all(type(v) is int for v in span):
        raise ValueError(f"rollout {r['sample_index']}: span must be two versions, "
                         f"got {span!r:.80}")
      rollouts.append(rollout_lib.HeldRollout(
          prompt_length=r["prompt_length"], completion_length=r["completion_length"],
          span=(span[0], span[1]), holder=held_by, copy=record["held_copy"], **common))
      continue
    for name, _, dtype in _TOKEN_ARRAYS:
      array = r[name]
      if (not isinstance(array, np.ndarray) or array.ndim != 1
          or array.dtype != np.dtype(dtype).newbyteorder("<")):
        raise ValueError(f"rollout {r.get('sample_index')!r}: {name} must be a 1-D "
                         f"{np.dtype(dtype)} array")
    rollouts.append(rollout_lib.Rollout(
        prompt_ids=r["prompt_ids"], completion_ids=r["completion_ids"], loss_mask=r["loss_mask"],
        behaviour_logprobs=r["logprobs"], token_versions=r["versions"], **common))
  return rollout_lib.Group(group_id=group_id, prompt_id=record["prompt_id"],
                           dispatch_version=dispatch_version, rollouts=rollouts)


def stats_to_wire(stats: engine_stats.EngineStats) -> dict:
  return dataclasses.asdict(stats)


def stats_from_wire(record: dict) -> engine_stats.EngineStats:
  """ValueError unless `record` is a dict of numbers (unknown keys ignored)."""
  if not isinstance(record, dict):
    raise ValueError(f"engine stats must be an object, got {type(record).__name__}")
  fields = {f.name for f in dataclasses.fields(engine_stats.EngineStats)}
  return engine_stats.EngineStats(**{k: _number(v, f"stats.{k}") for k, v in record.items()
                                     if k in fields})


def _number(value, what: str):
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"{what} must be a number, got {value!r:.80}")
  return value


def check_fields(record, what: str, types: dict) -> None:
  """ValueError unless `record` is a dict holding `types`' keys with values of
  those types (what a peer sends is checked before anything uses it)."""
  if not isinstance(record, dict):
    raise ValueError(f"{what} must be an object, got {type(record).__name__}")
  for key, kind in types.items():
    if key not in record:
      raise ValueError(f"{what} without {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, kind):
      raise ValueError(f"{what}.{key} has the wrong type ({type(value).__name__})")
