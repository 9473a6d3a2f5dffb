"""One `metrics.jsonl` row per update: this batch's numbers merged with what
each component reports of itself (`Orchestrator.metrics`, `Rollouts.metrics`)."""

from __future__ import annotations

import collections

import numpy as np


def step_record(*, step: int, version: int, batch_shape, batch_fill: float, batch,
                update_metrics: dict,
                components: dict, step_seconds: float, rl_seconds: float,
                learner_wait: float) -> dict:
  """The row of update `step` (which produced `version`).

  Args:
    step: the update's index (it trained `B_step`).
    version: the version it produced.
    batch_shape: `(rows, columns)` of the TrainBatch it trained.
    batch_fill: the share of its columns that hold a token.
    batch: the orchestrator's `Batch` (groups, stale sweep, masked rows).
    update_metrics: the update step's metrics (host scalars).
    components: the components' own numbers (orchestrator, rollouts), merged.
    step_seconds: wall time since the previous row.
    rl_seconds: wall time since RL started.
    learner_wait: seconds the learner has waited for batches so far.
  """
  trained_tokens = float(update_metrics["trained_tokens"])
  rollouts = [r for g in batch.groups for r in g.rollouts]
  in_flight = [sum(r.timings.get(k, 0.0) for k in ("queued", "generating", "in_env"))
               for r in rollouts]
  in_buffer = [r.timings.get("in_buffer", 0.0) for r in rollouts]
  record = {
      "step": step,
      "version": version,
      "reward_mean": float(np.mean([r.reward for r in rollouts])),
      "reward_by_env": _reward_by_env(batch.groups),
      **batch.lag_metrics(),
      "seconds_in_flight": float(np.mean(in_flight)),
      "seconds_in_buffer": float(np.mean(in_buffer)),
      "tokens_per_s": trained_tokens / max(step_seconds, 1e-9),
      "step_seconds": step_seconds,
      "wall_s": rl_seconds,
      # This batch: groups swept as stale before it, rows masked in it.
      "stale_groups_swept": len(batch.stale),
      "masked_env_error": int(batch.masked["env_error"]),
      "masked_truncated": int(batch.masked["truncated"]),
      # Rows whose trained tokens were sampled by more than one policy version.
      "multi_version_fraction": float(np.mean([_version_spread(r) > 0 for r in rollouts])),
      # The trained rows: padded (one rollout each) or packed; the share of
      # their columns that hold a token.
      "batch_rows": int(batch_shape[0]),
      "batch_columns": int(batch_shape[1]),
      "batch_fill": float(batch_fill),
      **components,
      # Shares of the RL wall time so far: the learner not waiting for a
      # batch, the sampler thread decoding, prefilling or swapping.
      "learner_busy_fraction": 1.0 - learner_wait / max(rl_seconds, 1e-9),
  }
  parts = _reward_parts_by_env(rollouts)
  if parts:
    record["reward_parts"] = parts
  if "sampler_busy_s" in components:
    record["sampler_busy_fraction"] = components["sampler_busy_s"] / max(rl_seconds, 1e-9)
  record.update({k: float(v) for k, v in update_metrics.items()})
  return record


def batch_summary(batch, host_batch) -> dict:
  """What tests keep of each trained batch (`run(..., keep_batches=True)`)."""
  return {"batch_version": batch.batch_version, "lag": batch.rollout_lags(),
          "token_versions": host_batch.token_versions.copy(),
          "tokens": host_batch.tokens.copy(), "token_mask": host_batch.token_mask.copy(),
          "segment_ids": host_batch.segment_ids.copy(),
          "behaviour_logprobs": host_batch.behaviour_logprobs.copy(),
          "loss_mask": host_batch.loss_mask.copy(),
          "dispatch_versions": [g.dispatch_version for g in batch.groups],
          "group_ids": [g.group_id for g in batch.groups],
          "prompt_ids": [g.prompt_id for g in batch.groups]}


def _reward_by_env(groups) -> dict[str, float]:
  rewards = collections.defaultdict(list)
  for g in groups:
    for r in g.rollouts:
      rewards[r.env_name].append(r.reward)
  return {name: float(np.mean(v)) for name, v in sorted(rewards.items())}


def _reward_parts_by_env(rollouts) -> dict[str, dict[str, float]]:
  """`{env: {part: mean}}` over this batch's rollouts whose score had parts
  (`envs/env_api.Score`); a part is averaged over the rollouts that have it."""
  parts = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in rollouts:
    for name, value in r.reward_parts.items():
      parts[r.env_name][name].append(value)
  return {env: {name: float(np.mean(v)) for name, v in sorted(by_part.items())}
          for env, by_part in sorted(parts.items())}


def _version_spread(rollout) -> int:
  """Newest minus oldest version among a rollout's trained tokens (0 if none)."""
  oldest, newest = rollout.version_span  # (the dispatch version twice when none)
  return newest - oldest
