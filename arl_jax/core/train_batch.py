"""`TrainBatch`: fixed-shape arrays the learner step consumes (docs/design.md section 3).

Every field is per token, `[R, W]`: R rows of W columns holding the batch's
rollouts (prompt then completion, each rollout one segment) where `packing.py`
places them. Padded rows (the default) hold one rollout each, its prompt
left-padded to the bucket so that every completion starts at the same column,
exactly as in the sampler; W is then the prompt bucket plus the batch's
longest completion rounded up to a power of two (`completion_width`), so the
jitted update compiles once per width (a handful), not per batch. Packed rows
(`learner.pack_len`) hold several rollouts each. Either way the learner reads
positions and the attention's segments from the batch, and everything per
rollout (advantage, reward) lies on its tokens, so a row never needs to know
which rollouts it holds.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import numpy as np

from arl_jax.core import advantages as advantages_lib
from arl_jax.core import packing as packing_lib
from arl_jax.core import rollout as rollout_lib


@flax.struct.dataclass
class TrainBatch:
  """Attributes (R rows, W columns; all `[R, W]`):
    tokens: int32, the rollouts' prompt and completion tokens; pad elsewhere.
    token_mask: bool, real tokens.
    loss_mask: float32, 1 on tokens the policy sampled and may train on.
    behaviour_logprobs: float32 recorded at sampling, 0 elsewhere.
    token_versions: int32 version that sampled each token, -1 elsewhere.
    segment_ids: int32, 0 on padding, k on the row's k-th rollout (k >= 1):
      a token attends only to earlier tokens of its own segment.
    positions: int32 RoPE positions, from 0 at each rollout's first token.
    advantages: float32, the rollout's advantage on each of its tokens.
    rewards: float32, the rollout's reward on each of its tokens.
  """

  tokens: jax.Array
  token_mask: jax.Array
  loss_mask: jax.Array
  behaviour_logprobs: jax.Array
  token_versions: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  advantages: jax.Array
  rewards: jax.Array


# Each field's dtype and the value of the columns no rollout covers (None:
# the tokenizer's pad id): the one definition of a batch's layout (`zeros`,
# the multi-controller broadcast) that `assemble` produces.
FIELDS = {"tokens": (np.int32, None), "token_mask": (np.bool_, False),
          "loss_mask": (np.float32, 0.0), "behaviour_logprobs": (np.float32, 0.0),
          "token_versions": (np.int32, rollout_lib.NO_VERSION), "segment_ids": (np.int32, 0),
          "positions": (np.int32, 0), "advantages": (np.float32, 0.0),
          "rewards": (np.float32, 0.0)}


def zeros(rows: int, columns: int) -> TrainBatch:
  """A host batch of zeros shaped and typed as `assemble` makes them."""
  return TrainBatch(**{name: np.zeros((rows, columns), dtype)
                       for name, (dtype, _) in FIELDS.items()})


def completion_width(groups: list[rollout_lib.Group], max_new_tokens: int,
                     floor: int = 16) -> int:
  """Columns a batch's completions are padded to: the smallest power of two
  (at least `floor`) that holds its longest completion, capped at
  `max_new_tokens`. A batch of short completions then costs the learner a
  fraction of a full-width one, at the price of one compile per width (a
  handful: powers of two)."""
  longest = max(r.completion_length for g in groups for r in g.rollouts)
  width = max(floor, 1 << max(longest - 1, 0).bit_length())
  return min(width, max_new_tokens)


@dataclasses.dataclass(frozen=True)
class Plan:
  """A batch's layout and what lies on each rollout's tokens besides its own
  arrays, decided from the rollouts' metadata alone (lengths, rewards,
  finish reasons), so that the process holding a rollout's arrays can fill
  its rows without the others (`distributed/shard_plan.py`). Rollout i is
  the i-th of the batch's groups' rollouts in order.

  Attributes:
    layout: where rollout i lies (`packing.Layout`).
    advantages: `[N]` float32, rollout i's advantage.
    segments: `[N]` int32, rollout i's segment id in its row (1 = the first).
    masked: `[N]` bool, rollout i is kept out of the loss (`Rollout.is_masked`).
  """

  layout: packing_lib.Layout
  advantages: np.ndarray
  segments: np.ndarray
  masked: np.ndarray


def completion_budget(groups: list[rollout_lib.Group], max_new_tokens: int,
                      packing: packing_lib.Packing | None) -> int:
  """The completion columns `assemble` / `plan` get for a batch: the budget
  when rows are packed (packing chooses their width), the batch's
  `completion_width` when they are padded."""
  return max_new_tokens if packing is not None else completion_width(groups, max_new_tokens)


def plan(groups: list[rollout_lib.Group], *, prompt_len: int, max_new_tokens: int,
         advantage_estimator: str, mask_truncated_completions: bool = False,
         packing: packing_lib.Packing | None = None, blocks=None, num_blocks: int = 1,
         num_slices: int = 1) -> Plan:
  """The `Plan` of a batch of whole groups (`assemble`'s arguments; `blocks`
  and `num_blocks` as `packing.packed` / `packing.padded` take them: the
  learner process each rollout is trained on; `num_slices`: the update's
  minibatches, for padded rows in blocks)."""
  rewards = np.stack([g.rewards for g in groups])  # [num_groups, G]
  masked = np.array([r.is_masked(mask_truncated_completions) for g in groups
                     for r in g.rollouts])
  advantages = advantages_lib.group_advantages(rewards, advantage_estimator,
                                               valid=~masked.reshape(rewards.shape)).reshape(-1)
  rollouts = [r for g in groups for r in g.rollouts]
  for g in groups:
    for r in g.rollouts:
      p, c = r.prompt_length, r.completion_length
      if p > prompt_len or c > max_new_tokens or p < 1:
        raise ValueError(f"rollout of group {g.group_id} has prompt {p} / completion {c} tokens; "
                         f"the batch holds 1..{prompt_len} / {max_new_tokens}")
  prompt_lengths = np.array([r.prompt_length for r in rollouts])
  lengths = prompt_lengths + np.array([r.completion_length for r in rollouts])
  if packing is None:
    layout = packing_lib.padded(prompt_lengths, prompt_len, prompt_len + max_new_tokens,
                                blocks=blocks, num_blocks=num_blocks,
                                num_slices=num_slices)
  else:
    layout = packing_lib.packed(lengths, packing, blocks=blocks, num_blocks=num_blocks)
  # Segment ids count a row's rollouts from its first column.
  order = np.lexsort((layout.start, layout.row))
  segments = np.zeros(len(rollouts), np.int32)
  for k, i in enumerate(order):
    first_in_row = k == 0 or layout.row[order[k - 1]] != layout.row[i]
    segments[i] = 1 if first_in_row else segments[order[k - 1]] + 1
  return Plan(layout=layout, advantages=advantages.astype(np.float32), segments=segments,
              masked=masked)


def empty_rows(rows: int, columns: int, pad_id: int) -> dict[str, np.ndarray]:
  """`FIELDS` as `[rows, columns]` arrays holding their padding values."""
  return {name: np.full((rows, columns), pad_id if fill is None else fill, dtype)
          for name, (dtype, fill) in FIELDS.items()}


def fill(arrays: dict[str, np.ndarray], batch_plan: Plan, rollouts: dict[int, rollout_lib.Rollout],
         first_row: int = 0) -> None:
  """Writes rollouts `{i: rollout i}` where `batch_plan` places them into
  `arrays` (`empty_rows`), which hold the batch's rows from `first_row`."""
  layout = batch_plan.layout
  for i, r in rollouts.items():
    p = r.prompt_length
    n = p + r.completion_length
    loss = np.zeros(n - p) if batch_plan.masked[i] else r.loss_mask
    # Prompt tokens carry no loss, no behaviour log-prob and no version.
    values = {"tokens": (r.prompt_ids, r.completion_ids), "token_mask": (True,),
              "loss_mask": (np.zeros(p), loss), "behaviour_logprobs": (np.zeros(p),
                                                                       r.behaviour_logprobs),
              "token_versions": (np.full(p, rollout_lib.NO_VERSION), r.token_versions),
              "segment_ids": (batch_plan.segments[i],), "positions": (np.arange(n),),
              "advantages": (batch_plan.advantages[i],), "rewards": (r.reward,)}
    row, cols = layout.row[i] - first_row, slice(layout.start[i], layout.start[i] + n)
    for name, parts in values.items():
      arrays[name][row, cols] = np.concatenate(parts) if len(parts) > 1 else parts[0]


def assemble(groups: list[rollout_lib.Group], *, prompt_len: int, max_new_tokens: int,
             pad_id: int, advantage_estimator: str, mask_truncated_completions: bool = False,
             packing: packing_lib.Packing | None = None) -> TrainBatch:
  """Builds a host (numpy) TrainBatch from whole groups.

  Padded rows (`packing` None) are `prompt_len + max_new_tokens` wide; packed
  rows as `packing_lib.packed` chooses. Masked rollouts (`Rollout.is_masked`:
  environment faults, and truncated completions when
  `mask_truncated_completions`) keep their tokens for the record but get loss
  mask 0 and do not shift their group's baseline: they carry no signal.
  """
  batch_plan = plan(groups, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                    advantage_estimator=advantage_estimator,
                    mask_truncated_completions=mask_truncated_completions, packing=packing)
  arrays = empty_rows(batch_plan.layout.rows, batch_plan.layout.width, pad_id)
  fill(arrays, batch_plan, dict(enumerate(r for g in groups for r in g.rollouts)))
  return TrainBatch(**arrays)


def from_rows(tokens, token_mask, loss_mask, behaviour_logprobs, token_versions, advantages,
              rewards) -> TrainBatch:
  """A TrainBatch of rows holding one sequence each (its real tokens one run
  of `token_mask`), from per-row `advantages` and `rewards` `[R]`; the
  per-token fields as in the class docstring."""
  token_mask = np.asarray(token_mask, bool)
  on = token_mask.astype(np.float32)
  return TrainBatch(
      tokens=np.asarray(tokens, np.int32), token_mask=token_mask,
      loss_mask=np.asarray(loss_mask, np.float32),
      behaviour_logprobs=np.asarray(behaviour_logprobs, np.float32),
      token_versions=np.asarray(token_versions, np.int32),
      segment_ids=token_mask.astype(np.int32),
      positions=np.maximum(np.cumsum(token_mask, axis=1) - 1, 0).astype(np.int32),
      advantages=on * np.asarray(advantages, np.float32)[:, None],
      rewards=on * np.asarray(rewards, np.float32)[:, None])
