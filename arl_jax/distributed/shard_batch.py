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

import dataclasses

import jax
import numpy as np

from arl_jax.core import train_batch as train_batch_lib
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
      holds (`plan.holder` == this process); KeyError when it holds none.
    mesh: the learner mesh.
    pad_id: the tokenizer's padding id.
    blocks_of_process: `shard_plan.row_blocks(mesh)`.

  Raises:
    RuntimeError: on every process together, when a process does not hold a
      rollout the plan says it holds (none waits in a collective for it).
  """
  me = jax.process_index()
  my_block = blocks_of_process[me]
  moved = plan.moved(blocks_of_process)
  mine_here = np.flatnonzero((plan.holder == me) & (moved | (plan.block == my_block)))
  held = _fetch(here, [(plan.group_ids[i], plan.sample_index[i]) for i in mine_here], mesh)
  held = dict(zip(mine_here.tolist(), held))
  sizes = np.array([held_groups.num_bytes(p, c) for p, c in
                    zip(plan.prompt_length, plan.completion_length)], np.int64) * moved
  mine = {}
  received = 0
  if sizes.any():
    data = b"".join(held_groups.to_bytes(held[i])
                    for i in np.flatnonzero(moved & (plan.holder == me)))
    gathered, offsets = _exchange(data, plan.holder, sizes, mesh)
    received = gathered.nbytes - gathered.shape[1]  # (the others' rows)
    for i in np.flatnonzero(moved & (plan.block == my_block) & (plan.holder != me)):
      mine[int(i)] = held_groups.from_bytes(
          gathered[plan.holder[i]], int(offsets[i]), int(plan.prompt_length[i]),
          int(plan.completion_length[i]), float(plan.rewards[i]))
  for i in np.flatnonzero((plan.block == my_block) & (plan.holder == me)):
    mine[int(i)] = held[int(i)]
  rows = plan.rows_per_block
  arrays = train_batch_lib.empty_rows(rows, plan.width, pad_id)
  train_batch_lib.fill(arrays, plan.batch_plan(), mine, first_row=my_block * rows)
  shardings = update_lib.batch_shardings(mesh)
  batch = train_batch_lib.TrainBatch(**{
      name: jax.make_array_from_process_local_data(getattr(shardings, name), arrays[name],
                                                   (plan.rows, plan.width))
      for name in train_batch_lib.FIELDS})
  return batch, int(received)


def _fetch(here, keys, mesh) -> list:
  """`here(group_id, sample_index)` of every key; then every process learns
  whether every process had all of its own (a small all-gather), and all
  raise together if one did not."""
  found, missing = [], []
  for gid, s in keys:
    try:
      found.append(here(int(gid), int(s)))
    except KeyError:
      missing.append(int(gid))
  counts = np.frombuffer(lockstep.all_gather(np.int32(len(missing)).tobytes(), 4, mesh)
                         .tobytes(), "<i4")
  if counts.any():
    lacking = {p: int(n) for p, n in enumerate(counts) if n}
    raise RuntimeError(
        f"processes {lacking} (process: rollouts) do not hold rollouts process 0's plan says "
        f"they hold (this process lacks groups {sorted(set(missing))[:8]}); the step cannot "
        "be trained")
  return found


def _exchange(data: bytes, senders, sizes, mesh) -> tuple[np.ndarray, np.ndarray]:
  """Every process's `data` (the `to_bytes` of its items, in order) on every
  process: `(gathered [processes, S], offsets [N])`, item i at `offsets[i]`
  of its sender's row `gathered[senders[i]]` (`sizes[i]` bytes, 0 for an
  item not sent)."""
  per_process = np.bincount(senders, weights=sizes, minlength=jax.process_count())
  gathered = lockstep.all_gather(data, _bucket(int(per_process.max())), mesh)
  offsets = np.zeros(len(senders), np.int64)
  for process in range(jax.process_count()):  # each sender's items, in order
    ids = np.flatnonzero(senders == process)
    offsets[ids] = np.cumsum(sizes[ids]) - sizes[ids]
  return gathered, offsets


def _bucket(size: int) -> int:
  """A gathered size rounded up to the next of 8 steps per power of two (at
  least 1 KiB; at most 1/8 padding): a few compiled shapes, not one per step."""
  if size <= 1024:
    return 1024
  step = 1 << ((size - 1).bit_length() - 3)
  return -(-size // step) * step


def collect_held(run_record: dict | None, here, mesh) -> None:
  """Before a save: the completions of held groups in process 0's open work
  (`run_record["work"]`, a `work_record.WorkRecord` whose `done` episodes with
  `held_by` are replaced by ones with their arrays) come
  from their holders (`here`, as in `local_batch`; the others pass
  `run_record` None). Every process calls it at the same point."""
  leader = run_record is not None
  entries = []
  if leader:
    for g, group in enumerate(run_record["work"].groups):
      for index, episode in enumerate(group.episodes):
        if episode.held_by is not None:
          entries.append((group.group_id, index, episode.held_by, episode.completion_length,
                          (g, episode)))
  count = int(lockstep.broadcast(np.array([len(entries)], np.int32), mesh)[0])
  if not count:
    return
  # (Rows padded with holder -1 to a power of two: a handful of shapes.)
  table = np.full((shard_plan_lib.padded_count(count), 4), -1, np.int32)
  if leader:
    table[:count] = [e[:4] for e in entries]
  table = lockstep.broadcast(table, mesh)[:count]
  sizes = np.array([held_groups.num_bytes(0, c, prompt=False) for c in table[:, 3]], np.int64)
  me = jax.process_index()
  rollouts = _fetch(here, [(g, s) for g, s, holder, _ in table if holder == me], mesh)
  data = b"".join(held_groups.to_bytes(r, prompt=False) for r in rollouts)
  gathered, offsets = _exchange(data, table[:, 2], sizes, mesh)
  if not leader:
    return
  work = run_record["work"]
  groups = [list(group.episodes) for group in work.groups]
  for (_, index, holder, length, (g, episode)), offset in zip(entries, offsets):
    arrays = held_groups.from_bytes(gathered[holder], int(offset), 0, length,
                                    episode.reward, prompt=False)
    groups[g][index] = dataclasses.replace(
        episode, held_by=None, completion_length=None,
        completion_ids=tuple(arrays.completion_ids.tolist()),
        loss_mask=tuple(arrays.loss_mask.tolist()),
        logprobs=tuple(arrays.behaviour_logprobs.tolist()),
        versions=tuple(arrays.token_versions.tolist()))
  run_record["work"] = dataclasses.replace(work, groups=tuple(
      dataclasses.replace(group, episodes=tuple(episodes))
      for group, episodes in zip(work.groups, groups)))


class LeaderShards:
  """Process 0's side of the process-local batch: plans each cut batch and
  builds its own block."""

  def __init__(self, spec, *, mesh, fleet, is_open, pad_id: int):
    """Args: the run spec, the learner mesh, the fleet (the held groups that
    will never train), `is_open(group_id)` (still in the run's open work:
    `OpenWork.is_open`), the tokenizer's padding id."""
    self._spec = spec
    self._mesh = mesh
    self._fleet = fleet
    self._is_open = is_open
    self._pad_id = pad_id
    self.blocks_of_process = shard_plan_lib.row_blocks(mesh)
    self.bytes_received = 0  # token bytes that reached this process (moved rollouts)

  def plan(self, batch) -> shard_plan_lib.ShardPlan:
    """The `ShardPlan` of a cut `orchestrator.Batch`; the held groups that
    left the run since the last plan (swept, cancelled, late) are forgotten
    by their holders."""
    spec = self._spec
    forget = self._fleet.take_forgotten(self._is_open)
    return shard_plan_lib.make(
        batch.groups, blocks_of_process=self.blocks_of_process, prompt_len=spec.engine.prompt_len,
        max_new_tokens=spec.engine.max_new_tokens,
        advantage_estimator=spec.loss.objective.advantage,
        mask_truncated_completions=spec.orchestrator.mask_truncated_completions,
        packing=spec.packing,
        num_slices=spec.loss.layout.num_minibatches, forget=forget)

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
