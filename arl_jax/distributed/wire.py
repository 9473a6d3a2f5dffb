"""What crosses the wire between the learner and its sampler processes, as JSON.

Group requests go out, finished groups come back. JSON, not pickle: a sampler
process must never be able to make the learner run code, and the messages stay
readable when debugging a fleet. Token lists are small (a group is at most a
few thousand tokens) and float32 log-probs round-trip exactly through a JSON
double, so a rollout arrives bit-for-bit as it was sampled.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from arl_jax import rollout as rollout_lib
from arl_jax.envs import prompt_codec
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.sampler import engine_stats


def encode(message: dict) -> bytes:
  return json.dumps(message, separators=(",", ":")).encode()


def decode(frame: bytes) -> dict:
  message = json.loads(frame)
  if not isinstance(message, dict) or "type" not in message:
    raise ValueError(f"not a fleet message: {frame[:200]!r}")
  return message


def request_to_json(request: dispatcher_lib.GroupRequest) -> dict:
  return {"group_id": request.group_id, "prompt": prompt_codec.to_json(request.prompt),
          "prompt_ids": [int(t) for t in request.prompt_ids],
          "dispatch_version": request.dispatch_version, "group_size": request.group_size,
          "attempt": request.attempt, "max_new_tokens": request.max_new_tokens}


def request_from_json(record: dict) -> dispatcher_lib.GroupRequest:
  """The request as the sampler process sees it; its `dispatch_time` is this
  process's clock at arrival (the learner's clock means nothing here)."""
  return dispatcher_lib.GroupRequest(
      group_id=int(record["group_id"]), prompt=prompt_codec.from_json(record["prompt"]),
      prompt_ids=tuple(int(t) for t in record["prompt_ids"]),
      dispatch_version=int(record["dispatch_version"]), group_size=int(record["group_size"]),
      dispatch_time=time.monotonic(), attempt=int(record["attempt"]),
      max_new_tokens=record["max_new_tokens"])


def group_to_json(group: rollout_lib.Group) -> dict:
  return {
      "group_id": group.group_id, "prompt_id": group.prompt_id,
      "dispatch_version": group.dispatch_version,
      "rollouts": [{
          "sample_index": r.sample_index, "prompt_ids": r.prompt_ids.tolist(),
          "completion_ids": r.completion_ids.tolist(), "loss_mask": r.loss_mask.tolist(),
          "logprobs": r.behaviour_logprobs.tolist(), "versions": r.token_versions.tolist(),
          "finish_reason": r.finish_reason, "reward": r.reward, "env_name": r.env_name,
          "timings": r.timings} for r in group.rollouts],
  }


def group_from_json(record: dict) -> rollout_lib.Group:
  """Raises ValueError (from `Rollout`'s own checks) on an inconsistent record."""
  group_id, dispatch_version = int(record["group_id"]), int(record["dispatch_version"])
  rollouts = [rollout_lib.Rollout(
      group_id=group_id, sample_index=int(r["sample_index"]),
      prompt_ids=np.asarray(r["prompt_ids"], np.int32),
      completion_ids=np.asarray(r["completion_ids"], np.int32),
      loss_mask=np.asarray(r["loss_mask"], np.float32),
      behaviour_logprobs=np.asarray(r["logprobs"], np.float32),
      token_versions=np.asarray(r["versions"], np.int32), dispatch_version=dispatch_version,
      finish_reason=r["finish_reason"], reward=r["reward"], env_name=r["env_name"],
      timings={k: float(v) for k, v in r["timings"].items()}) for r in record["rollouts"]]
  return rollout_lib.Group(group_id=group_id, prompt_id=int(record["prompt_id"]),
                           dispatch_version=dispatch_version, rollouts=rollouts)


def stats_to_json(stats: engine_stats.EngineStats) -> dict:
  return dataclasses.asdict(stats)


def stats_from_json(record: dict) -> engine_stats.EngineStats:
  fields = {f.name for f in dataclasses.fields(engine_stats.EngineStats)}
  return engine_stats.EngineStats(**{k: v for k, v in record.items() if k in fields})

