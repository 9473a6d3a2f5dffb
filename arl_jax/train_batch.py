"""`TrainBatch`: fixed-shape arrays the learner step consumes (docs/design.md section 3).

Rows are rollouts, `[B, L]` with `L = prompt bucket + completion width`: the
width is the batch's longest completion rounded up to a power of two (at least
16, at most `max_new_tokens`; `completion_width`), so the jitted update
compiles once per width (a handful), not per batch. Prompts are left-padded to
the bucket so that every completion starts at the same column, exactly as in
the sampler: the same columns, masks and positions give the same log-probs.
"""

from __future__ import annotations

import flax.struct
import jax
import numpy as np

from arl_jax import advantages as advantages_lib
from arl_jax import rollout as rollout_lib
from arl_jax import rows as rows_lib
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


# Each field's dtype and whether it is per token (`[B, L]`) or per row
# (`[B]`): the one definition of a batch's layout (`zeros`, the
# multi-controller broadcast) that `assemble` produces.
FIELDS = {"tokens": (np.int32, True), "token_mask": (np.bool_, True),
          "loss_mask": (np.float32, True), "behaviour_logprobs": (np.float32, True),
          "token_versions": (np.int32, True), "advantages": (np.float32, False),
          "rewards": (np.float32, False), "group_ids": (np.int32, False),
          "lag": (np.int32, False)}


def zeros(rows: int, columns: int) -> TrainBatch:
  """A host batch of zeros shaped and typed as `assemble` makes them."""
  return TrainBatch(**{name: np.zeros((rows, columns) if per_token else (rows,), dtype)
                       for name, (dtype, per_token) in FIELDS.items()})


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
  rewards = np.stack([g.rewards for g in groups])  # [num_groups, G]
  valid = np.array([[not r.is_masked(mask_truncated_completions) for r in g.rollouts]
                    for g in groups])
  advantages = advantages_lib.group_advantages(rewards, advantage_estimator,
                                               valid=valid).reshape(-1)
  lag, group_ids = [], []
  for g in groups:
    group_lag = staleness.lag(batch_version, g, staleness_reference)
    for r in g.rollouts:
      p, c = len(r.prompt_ids), len(r.completion_ids)
      if p > prompt_len or c > max_new_tokens:
        raise ValueError(f"rollout of group {g.group_id} has prompt {p} / completion {c} tokens; "
                         f"the batch holds {prompt_len} / {max_new_tokens}")
      lag.append(group_lag)
      group_ids.append(g.group_id)
  rows = [r for g in groups for r in g.rollouts]
  # Prompts end at column `prompt_len`, where every completion starts; prompt
  # columns carry no loss, no behaviour log-prob and no version.
  prompts, prompt_mask = rows_lib.left_pad([r.prompt_ids for r in rows], prompt_len, pad_id)
  completion = lambda values, fill, dtype: rows_lib.right_pad(values, max_new_tokens, fill,
                                                              dtype)
  prompt_cols = lambda fill, dtype: np.full((len(rows), prompt_len), fill, dtype)
  completions, completion_mask = completion([r.completion_ids for r in rows], pad_id, np.int32)
  loss_mask, _ = completion([np.zeros(len(r.completion_ids))
                             if r.is_masked(mask_truncated_completions) else r.loss_mask
                             for r in rows], 0.0, np.float32)
  behaviour, _ = completion([r.behaviour_logprobs for r in rows], 0.0, np.float32)
  versions, _ = completion([r.token_versions for r in rows], rollout_lib.NO_VERSION, np.int32)
  return TrainBatch(
      tokens=np.concatenate([prompts, completions], axis=1),
      token_mask=np.concatenate([prompt_mask, completion_mask], axis=1),
      loss_mask=np.concatenate([prompt_cols(0.0, np.float32), loss_mask], axis=1),
      behaviour_logprobs=np.concatenate([prompt_cols(0.0, np.float32), behaviour], axis=1),
      token_versions=np.concatenate([prompt_cols(rollout_lib.NO_VERSION, np.int32), versions],
                                    axis=1),
      advantages=advantages, rewards=rewards.reshape(-1).astype(np.float32),
      group_ids=np.array(group_ids, np.int32), lag=np.array(lag, np.int32))
