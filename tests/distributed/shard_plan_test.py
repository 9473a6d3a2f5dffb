"""The batch plan of a multi-controller step: each rollout trains in its
holder's block unless balance needs it elsewhere, the layout keeps every
minibatch's rollouts in its rows, and the plan survives its broadcast form."""

import numpy as np
import pytest

from arl_jax.core import packing as packing_lib
from arl_jax.core import rollout as rollout_lib
from arl_jax.core import train_batch as train_batch_lib
from arl_jax.distributed import shard_plan
from arl_jax.testing import lockstep_worker

_SETTINGS = dict(prompt_len=64, max_new_tokens=448, advantage_estimator="grpo",
                 mask_truncated_completions=False)


def _as_seen_by_process0(groups, holders):
  return [g if holders[g.group_id] == 0 else rollout_lib.held_group(g, holders[g.group_id])
          for g in groups]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("num_slices", [1, 2])
def test_groups_fed_from_their_own_process_stay_there(packed, num_slices):
  groups, holders = lockstep_worker.synthetic_groups(8, 4, 2, "local", 64, 448)
  packing = packing_lib.Packing(pack_len=512, num_slices=num_slices, row_multiple=2) if packed else None
  plan = shard_plan.make(_as_seen_by_process0(groups, holders), blocks_of_process=[0, 1],
                         packing=packing, num_slices=num_slices, **_SETTINGS)
  np.testing.assert_array_equal(plan.block, plan.holder)
  assert not plan.moved([0, 1]).any()
  # Each block's rollouts lie in its rows, each minibatch's in its rows.
  np.testing.assert_array_equal(plan.row // plan.rows_per_block, plan.block)
  np.testing.assert_array_equal(plan.row % num_slices, np.arange(len(plan.row)) % num_slices)


def test_the_plan_lays_out_what_assemble_trains():
  """Rollout by rollout, the plan's batch holds the tokens, advantages and
  segments `assemble` gives them (only the places differ)."""
  groups, holders = lockstep_worker.synthetic_groups(6, 4, 2, "spread", 64, 448)
  groups[1].rollouts[2].finish_reason = "error"  # masked: no loss, out of the baseline
  packing = packing_lib.Packing(pack_len=512, num_slices=2, row_multiple=2)
  plan = shard_plan.make(_as_seen_by_process0(groups, holders), blocks_of_process=[0, 1],
                         packing=packing, num_slices=2, **_SETTINGS)
  whole = train_batch_lib.empty_rows(plan.rows, plan.width, 0)
  rollouts = [r for g in groups for r in g.rollouts]
  train_batch_lib.fill(whole, plan.batch_plan(), dict(enumerate(rollouts)))
  want = train_batch_lib.assemble(groups, pad_id=0, packing=packing, **_SETTINGS)
  layout = train_batch_lib.plan(groups, packing=packing, **_SETTINGS).layout
  for i, r in enumerate(rollouts):
    n = r.prompt_length + r.completion_length
    for name in train_batch_lib.FIELDS:
      if name == "segment_ids":
        continue
      got = whole[name][plan.row[i], plan.start[i]:plan.start[i] + n]
      np.testing.assert_array_equal(
          got, getattr(want, name)[layout.row[i], layout.start[i]:layout.start[i] + n], name)
  assert whole["token_mask"].sum() == want.token_mask.sum()
  masked = slice(plan.start[6], plan.start[6] + rollouts[6].prompt_length
                 + rollouts[6].completion_length)  # (rollout 6 is group 1's third)
  assert whole["loss_mask"][plan.row[6], masked].sum() == 0 and plan.masked[6]
  # Segments: consecutive from 1 in every row.
  for row in range(plan.rows):
    ids = [s for s in dict.fromkeys(whole["segment_ids"][row]) if s]
    assert ids == list(range(1, len(ids) + 1))


def test_packed_blocks_are_balanced_in_tokens():
  groups, holders = lockstep_worker.synthetic_groups(16, 4, 2, "process0", 64, 448)
  packing = packing_lib.Packing(pack_len=512, row_multiple=2)
  plan = shard_plan.make(_as_seen_by_process0(groups, holders), blocks_of_process=[0, 1],
                         packing=packing, num_slices=1, **_SETTINGS)
  lengths = plan.prompt_length + plan.completion_length
  load = np.bincount(plan.block, weights=lengths, minlength=2)
  assert abs(load[0] - load[1]) <= 512
  moved = plan.moved([0, 1])
  assert moved.sum() == (plan.block == 1).sum() > 0  # only what block 1 needs moved
  np.testing.assert_array_equal(plan.row // plan.rows_per_block, plan.block)


def test_padded_blocks_take_exactly_their_rows_of_each_minibatch():
  capacity = packing_lib.padded_capacity(12, 2, 4)  # rows 0..5 and 6..11
  np.testing.assert_array_equal(capacity, [[2, 2, 1, 1], [1, 1, 2, 2]])
  holders = np.zeros(12, np.int64)  # everything on block 0
  blocks = shard_plan.assign(np.ones(12), holders, num_blocks=2, num_slices=4, capacity=capacity)
  for j in range(4):
    np.testing.assert_array_equal(np.bincount(blocks[j::4], minlength=2), capacity[:, j])
  layout = packing_lib.padded(np.full(12, 3), 8, 16, blocks=blocks, num_blocks=2, num_slices=4)
  assert sorted(layout.row) == list(range(12))
  np.testing.assert_array_equal(layout.row % 4, np.arange(12) % 4)
  np.testing.assert_array_equal(layout.row // 6, blocks)


def test_the_plan_survives_its_broadcast_form():
  groups, holders = lockstep_worker.synthetic_groups(4, 4, 2, "spread", 64, 448)
  plan = shard_plan.make(_as_seen_by_process0(groups, holders), blocks_of_process=[0, 1],
                         packing=None, num_slices=1, forget=[(41, 2), (40, 1)], **_SETTINGS)
  arrays = plan.to_arrays()
  empty = shard_plan.ShardPlan.empty_arrays(len(plan.group_ids), len(plan.forget))
  assert {k: (a.shape, a.dtype) for k, a in arrays.items()} == {
      k: (a.shape, a.dtype) for k, a in empty.items()}
  back = shard_plan.ShardPlan.from_arrays(arrays)
  for name in ("rows", "width", "num_blocks"):
    assert getattr(back, name) == getattr(plan, name)
  for name in ("group_ids", "holder", "block", "row", "start", "segments", "advantages",
               "rewards", "forget", "masked"):
    np.testing.assert_array_equal(getattr(back, name), getattr(plan, name), name)
  np.testing.assert_array_equal(back.forget, [[40, 1], [41, 2]])
  assert sum(a.nbytes for a in arrays.values()) == 48 * len(plan.group_ids) + 8 * 8 + 12


def test_padded_rows_must_split_over_the_processes():
  groups, holders = lockstep_worker.synthetic_groups(3, 1, 2, "spread", 64, 448)
  with pytest.raises(ValueError, match="do not split over the 2 learner processes"):
    shard_plan.make(_as_seen_by_process0(groups, holders), blocks_of_process=[0, 1],
                    packing=None, num_slices=1, **_SETTINGS)


def test_one_process_is_one_block():
  import jax  # noqa: PLC0415
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1, 1), ("fsdp", "tp"))
  assert shard_plan.row_blocks(mesh) == [0]
