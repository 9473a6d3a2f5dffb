"""`TrainBatch`: fixed-shape arrays the learner step consumes (DESIGN.md section 3).

Rows are rollouts, `[B, L]` with `L = prompt bucket + max new tokens` fixed for
the run, so the jitted update step never recompiles. Prompts are left-padded to
the bucket so that every completion starts at the same column, exactly as in
the sampler: the same columns, masks and positions give the same log-probs.
"""

from __future__ import annotations

import flax.struct
import jax
import numpy as np

from arl_jax import rollout as rollout_lib
from arl_jax.learner import advantages as advantages_lib
from arl_jax.orchestrator import staleness


@flax.struct.dataclass
class TrainBatch:
  """Attributes (B rows = groups x G, L columns):
    tokens: `[B, L]` int32, left-padded prompt then completion then pad.
    token_mask: `[B, L]` bool, real tokens.
    loss_mask: `[B, L]` float32, 1 on tokens the policy sampled and may train on.
    behaviour_logprobs: `[B, L]` float32 recorded at sampling, 0 elsewhere.
    token_versions: `[B, L]` int32 version that sampled each token, -1 elsewhere.
    advantages: `[B]` float32 per-rollout advantage.
    rewards: `[B]` float32.
    group_ids: `[B]` int32.
    lag: `[B]` int32, lag of the row's group in this batch.
  """

  tokens: jax.Array
  token_mask: jax.Array
  loss_mask: jax.Array
  behaviour_logprobs: jax.Array
  token_versions: jax.Array
  advantages: jax.Array
  rewards: jax.Array
  group_ids: jax.Array
  lag: jax.Array


def completion_width(groups: list[rollout_lib.Group], max_new_tokens: int,
                     floor: int = 16) -> int:
  """Columns a batch's completions are padded to: the smallest power of two
  (at least `floor`) that holds its longest completion, capped at
  `max_new_tokens`. A batch of short completions then costs the learner a
  fraction of a full-width one, at the price of one compile per width (a
  handful: powers of two)."""
  longest = max(len(r.completion_ids) for g in groups for r in g.rollouts)
  width = max(floor, 1 << max(longest - 1, 0).bit_length())
  return min(width, max_new_tokens)


def assemble(groups: list[rollout_lib.Group], *, batch_version: int, prompt_len: int,
             max_new_tokens: int, pad_id: int, advantage_estimator: str,
             staleness_reference: str, mask_truncated_completions: bool = False) -> TrainBatch:
  """Builds a host (numpy) TrainBatch from whole groups.

  Masked rollouts (`Rollout.is_masked`: environment faults, and truncated
  completions when `mask_truncated_completions`) keep their tokens for the
  record but get loss mask 0 and do not shift their group's baseline: they
  carry no signal.
  """
  rows = [r for g in groups for r in g.rollouts]
  b, length = len(rows), prompt_len + max_new_tokens
  tokens = np.full((b, length), pad_id, np.int32)
  token_mask = np.zeros((b, length), bool)
  loss_mask = np.zeros((b, length), np.float32)
  behaviour = np.zeros((b, length), np.float32)
  versions = np.full((b, length), -1, np.int32)
  rewards = np.stack([g.rewards for g in groups])  # [num_groups, G]
  valid = np.array([[not r.is_masked(mask_truncated_completions) for r in g.rollouts]
                    for g in groups])
  advantages = advantages_lib.group_advantages(rewards, advantage_estimator,
                                               valid=valid).reshape(-1)
  lag = np.zeros((b,), np.int32)
  group_ids = np.zeros((b,), np.int32)
  i = 0
  for g in groups:
    group_lag = staleness.lag(batch_version, g, staleness_reference)
    for r in g.rollouts:
      p, c = len(r.prompt_ids), len(r.completion_ids)
      if p > prompt_len or c > max_new_tokens:
        raise ValueError(f"rollout of group {g.group_id} has prompt {p} / completion {c} tokens; "
                         f"the batch holds {prompt_len} / {max_new_tokens}")
      tokens[i, prompt_len - p:prompt_len] = r.prompt_ids
      token_mask[i, prompt_len - p:prompt_len + c] = True
      cols = slice(prompt_len, prompt_len + c)
      tokens[i, cols] = r.completion_ids
      loss_mask[i, cols] = 0.0 if r.is_masked(mask_truncated_completions) else r.loss_mask
      behaviour[i, cols] = r.behaviour_logprobs
      versions[i, cols] = r.token_versions
      lag[i] = group_lag
      group_ids[i] = g.group_id
      i += 1
  return TrainBatch(tokens=tokens, token_mask=token_mask, loss_mask=loss_mask,
                    behaviour_logprobs=behaviour, token_versions=versions,
                    advantages=advantages, rewards=rewards.reshape(-1).astype(np.float32),
                    group_ids=group_ids, lag=lag)
