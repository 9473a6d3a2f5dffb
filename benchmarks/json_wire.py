"""The JSON codec of finished groups that `arl_jax/distributed/wire.py`'s
binary format replaced (arl_jax before issue 23): every token id, mask value,
log-prob and version as decimal text. Kept as `benchmarks/data_plane.py`'s
comparison row, not used by the package."""

from __future__ import annotations

import numpy as np

from arl_jax.core import rollout as rollout_lib


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
