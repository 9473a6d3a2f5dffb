"""Each process builds its own rows of the global batch from the groups it holds.

A multi-controller step (`lockstep.Step`) carries a `ShardPlan`. Every
process then:

1. sends the rollouts the plan moves out of it and receives those it moves
   in: one all-gather over the learner devices of each process's outgoing
   bytes (`held_groups.to_bytes`), skipped when nothing moves, so a block
   whose groups all come from its own process moves no token bytes;
2. fills its block of rows (`train_batch.fill`) from its own groups and what
   it received;
3. makes the global `TrainBatch` of the blocks with
   `jax.make_array_from_process_local_data`, sharded as the update takes it
   (`update.batch_shardings`).

`collect_held` moves the arrays of held groups a checkpoint keeps (in its
open work) to process 0 before the save, so that a checkpoint holds every
finished group, as before.

`LeaderShards` is process 0's side: it plans each cut batch and builds its
block from the groups its own sampler (and any sampler process) delivered.
"""

from __future__ import annotations

import jax
import numpy as np

from arl_jax import train_batch as train_batch_lib
from arl_jax.distributed import held_groups, lockstep
from arl_jax.distributed import shard_plan as shard_plan_lib
from arl_jax.learner import update as update_lib


def local_batch(plan: shard_plan_lib.ShardPlan, here, mesh, *, pad_id: int,
                blocks_of_process: list[int]) -> tuple[train_batch_lib.TrainBatch, int]:
  """`(the global batch, token bytes this process received)`: this process's
  block filled from the rollouts it holds (`here(group_id, sample_index)`)
  and those the plan moves to it.

  Args:
    plan: the step's plan.
    here: `(group_id, sample_index) -> rollout` for rollouts this process
      holds (`plan.holder` == this process).
    mesh: the learner mesh.
    pad_id: the tokenizer's padding id.
    blocks_of_process: `shard_plan.row_blocks(mesh)`.
  """
  me = jax.process_index()
  my_block = blocks_of_process[me]
  moved = plan.moved(blocks_of_process)
  sizes = np.array([held_groups.num_bytes(p, c) for p, c in
                    zip(plan.prompt_length, plan.completion_length)], np.int64) * moved
  mine = {}
  received = 0
  if sizes.any():
    outgoing = np.flatnonzero(moved & (plan.holder == me))
    data = b"".join(held_groups.to_bytes(here(plan.group_ids[i], plan.sample_index[i]))
                    for i in outgoing)
    per_process = np.bincount(plan.holder, weights=sizes, minlength=jax.process_count())
    gathered = lockstep.all_gather(data, int(per_process.max()), mesh)
    received = gathered.nbytes - gathered.shape[1]  # (the others' rows)
    offsets = np.zeros(len(plan.holder), np.int64)
    for process in range(jax.process_count()):  # each sender's rollouts, in plan order
      ids = np.flatnonzero(moved & (plan.holder == process))
      offsets[ids] = np.cumsum(sizes[ids]) - sizes[ids]
    for i in np.flatnonzero(moved & (plan.block == my_block) & (plan.holder != me)):
      mine[int(i)] = held_groups.from_bytes(
          gathered[plan.holder[i]], int(offsets[i]), int(plan.prompt_length[i]),
          int(plan.completion_length[i]), float(plan.rewards[i]))
  for i in np.flatnonzero((plan.block == my_block) & (plan.holder == me)):
    mine[int(i)] = here(int(plan.group_ids[i]), int(plan.sample_index[i]))
  rows = plan.rows_per_block
  arrays = train_batch_lib.empty_rows(rows, plan.width, pad_id)
  train_batch_lib.fill(arrays, plan.batch_plan(), mine, first_row=my_block * rows)
  shardings = update_lib.batch_shardings(mesh)
  batch = train_batch_lib.TrainBatch(**{
      name: jax.make_array_from_process_local_data(getattr(shardings, name), arrays[name],
                                                   (plan.rows, plan.width))
      for name in train_batch_lib.FIELDS})
  return batch, int(received)


def collect_held(run_record: dict | None, here, mesh) -> None:
  """Before a save: the completions of held groups in process 0's open work
  (`run_record`, whose `done` episodes with `held_by` get their arrays) come
  from their holders (`here`, as in `local_batch`; the others pass
  `run_record` None). Every process calls it at the same point."""
  leader = run_record is not None
  entries = []
  if leader:
    for group in run_record["work"]["groups"]:
      for index, episode in enumerate(group["episodes"]):
        if "held_by" in episode:
          entries.append((group["group_id"], index, episode["held_by"],
                          episode["completion_length"], episode))
  count = int(lockstep.broadcast(np.array([len(entries)], np.int32), mesh)[0])
  if not count:
    return
  table = np.array([e[:4] for e in entries], np.int32).reshape(-1, 4)
  table = lockstep.broadcast(table if leader else np.zeros((count, 4), np.int32), mesh)
  sizes = np.array([held_groups.num_bytes(0, c, prompt=False) for c in table[:, 3]], np.int64)
  me = jax.process_index()
  data = b"".join(held_groups.to_bytes(here(int(g), int(s)), prompt=False)
                  for g, s, holder, _ in table if holder == me)
  per_process = np.bincount(table[:, 2], weights=sizes, minlength=jax.process_count())
  gathered = lockstep.all_gather(data, int(per_process.max()), mesh)
  if not leader:
    return
  offsets = np.zeros(jax.process_count(), np.int64)
  for (_, _, holder, length, episode), size in zip(entries, sizes):
    arrays = held_groups.from_bytes(gathered[holder], int(offsets[holder]), 0, length,
                                    episode["reward"], prompt=False)
    offsets[holder] += size
    del episode["held_by"], episode["completion_length"]
    episode.update(completion_ids=arrays.completion_ids.tolist(),
                   loss_mask=arrays.loss_mask.tolist(),
                   logprobs=arrays.behaviour_logprobs.tolist(),
                   versions=arrays.token_versions.tolist())


class LeaderShards:
  """Process 0's side of the process-local batch: plans each cut batch and
  builds its own block."""

  def __init__(self, spec, *, mesh, fleet, pad_id: int):
    """Args: the run spec, the learner mesh, the fleet (groups it told the
    holders to forget), the tokenizer's padding id."""
    self._spec = spec
    self._mesh = mesh
    self._fleet = fleet
    self._pad_id = pad_id
    self.blocks_of_process = shard_plan_lib.row_blocks(mesh)
    self.bytes_received = 0  # token bytes that reached this process (moved rollouts)

  def plan(self, batch) -> shard_plan_lib.ShardPlan:
    """The `ShardPlan` of a cut `orchestrator.Batch`; the stale groups swept
    before it are forgotten by their holders."""
    spec = self._spec
    forget = [g.group_id for g in batch.stale if g.holder is not None]
    forget += self._fleet.take_forgotten()
    return shard_plan_lib.make(
        batch.groups, blocks_of_process=self.blocks_of_process, prompt_len=spec.engine.prompt_len,
        max_new_tokens=spec.engine.max_new_tokens, advantage_estimator=spec.advantage_estimator,
        mask_truncated_completions=spec.mask_truncated_completions, packing=spec.packing,
        num_slices=spec.loss.num_minibatches, forget=forget)

  def local_batch(self, plan, batch) -> train_batch_lib.TrainBatch:
    """This process's block of `plan`'s batch (the cut `batch`'s full groups
    are the ones held here), as the global batch."""
    groups = {g.group_id: g for g in batch.groups if g.holder is None}
    device_batch, received = local_batch(
        plan, lambda gid, s: groups[int(gid)].rollouts[int(s)], self._mesh,
        pad_id=self._pad_id, blocks_of_process=self.blocks_of_process)
    self.bytes_received += received
    return device_batch

  def collect(self, run_record: dict) -> None:
    collect_held(run_record, None, self._mesh)
