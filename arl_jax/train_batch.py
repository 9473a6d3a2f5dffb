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

import flax.struct
import jax
import numpy as np

from arl_jax import advantages as advantages_lib
from arl_jax import packing as packing_lib
from arl_jax import rollout as rollout_lib


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
  longest = max(len(r.completion_ids) for g in groups for r in g.rollouts)
  width = max(floor, 1 << max(longest - 1, 0).bit_length())
  return min(width, max_new_tokens)


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
  rewards = np.stack([g.rewards for g in groups])  # [num_groups, G]
  valid = np.array([[not r.is_masked(mask_truncated_completions) for r in g.rollouts]
                    for g in groups])
  advantages = advantages_lib.group_advantages(rewards, advantage_estimator,
                                               valid=valid).reshape(-1)
  rollouts = [r for g in groups for r in g.rollouts]
  for g in groups:
    for r in g.rollouts:
      p, c = len(r.prompt_ids), len(r.completion_ids)
      if p > prompt_len or c > max_new_tokens or p < 1:
        raise ValueError(f"rollout of group {g.group_id} has prompt {p} / completion {c} tokens; "
                         f"the batch holds 1..{prompt_len} / {max_new_tokens}")
  prompt_lengths = np.array([len(r.prompt_ids) for r in rollouts])
  lengths = prompt_lengths + np.array([len(r.completion_ids) for r in rollouts])
  if packing is None:
    layout = packing_lib.padded(prompt_lengths, prompt_len, prompt_len + max_new_tokens)
  else:
    layout = packing_lib.packed(lengths, packing)
  batch = {name: np.full((layout.rows, layout.width), pad_id if fill is None else fill, dtype)
           for name, (dtype, fill) in FIELDS.items()}
  # Segment ids count a row's rollouts from its first column.
  order = np.lexsort((layout.start, layout.row))
  segment = np.zeros(len(rollouts), np.int32)
  for k, i in enumerate(order):
    first_in_row = k == 0 or layout.row[order[k - 1]] != layout.row[i]
    segment[i] = 1 if first_in_row else segment[order[k - 1]] + 1
  for i, r in enumerate(rollouts):
    p, n = prompt_lengths[i], lengths[i]
    loss = np.zeros(n - p) if r.is_masked(mask_truncated_completions) else r.loss_mask
    # Prompt tokens carry no loss, no behaviour log-prob and no version.
    values = {"tokens": (r.prompt_ids, r.completion_ids), "token_mask": (True,),
              "loss_mask": (np.zeros(p), loss), "behaviour_logprobs": (np.zeros(p),
                                                                       r.behaviour_logprobs),
              "token_versions": (np.full(p, rollout_lib.NO_VERSION), r.token_versions),
              "segment_ids": (segment[i],), "positions": (np.arange(n),),
              "advantages": (advantages[i],), "rewards": (r.reward,)}
    cols = slice(layout.start[i], layout.start[i] + n)
    for name, parts in values.items():
      batch[name][layout.row[i], cols] = np.concatenate(parts) if len(parts) > 1 else parts[0]
  return TrainBatch(**batch)


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
