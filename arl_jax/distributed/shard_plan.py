"""Which learner process trains each rollout of a batch, decided from metadata.

In a multi-controller run the learner's batch rows are sharded over the
`fsdp` axis, whose devices run in process order, so each process's devices
hold one block of consecutive rows (`row_blocks`). Process 0's orchestrator
holds only the metadata of the groups the other processes sampled
(`rollout.HeldRollout`); their arrays stay where they were sampled
(`held_groups.py`). Before each update process 0 makes a `ShardPlan`:

- each rollout is trained in its holder's block, unless that block has more
  than its share: padded rows give every block a fixed count of each
  minibatch's rows; packed rows are balanced in tokens (a rollout moves from
  the fullest block to the emptiest while they differ by more than a full
  row, `pack_len` tokens). Only the rollouts that move cross processes.
- the layout (`train_batch.plan` with the blocks): every process fills its
  own block's rows, and the global batch is made of the blocks
  (`shard_batch.local_batch`);
- advantages, segment ids and loss masks, computed from the whole batch's
  metadata (a group's baseline needs all its rewards);
- `forget`: the held groups (id, copy) their holders may drop, never to be
  trained (swept as stale, cancelled, arrived late or malformed).

The plan travels to every process as a few small arrays (`to_arrays`): 48
bytes per rollout, kilobytes per step, instead of the batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq

import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arl_jax.core import packing as packing_lib
from arl_jax.core import train_batch as train_batch_lib

# The plan's per-rollout integer rows, in `to_arrays` order.
_INT_ROWS = ("group_ids", "sample_index", "holder", "block", "row", "start", "prompt_length",
             "completion_length", "segments", "masked")
_FLOAT_ROWS = ("advantages", "rewards")


def row_blocks(mesh: Mesh) -> list[int]:
  """The block of the learner batch's rows each process's devices hold
  (rows sharded over `fsdp`, `update.batch_shardings`): process p's block
  is `row_blocks(mesh)[p]` of `max(...) + 1` equal blocks in order
  (processes that share a block each get all of its rows)."""
  size = mesh.shape.get("fsdp", 1)
  sharding = NamedSharding(mesh, P("fsdp" if "fsdp" in mesh.axis_names else None))
  ranges: dict[int, set] = {}
  for device, index in sharding.devices_indices_map((size,)).items():
    covered = range(size)[index[0]]
    ranges.setdefault(device.process_index, set()).update(covered)
  spans = []
  for process in sorted(ranges):
    covered = sorted(ranges[process])
    if covered != list(range(covered[0], covered[-1] + 1)):
      raise ValueError(f"process {process}'s learner devices hold rows {covered} of {size}: "
                       "not one block (the mesh must list every process's devices in order)")
    spans.append((covered[0], covered[-1] + 1))
  distinct = sorted(set(spans))
  widths = {b - a for a, b in distinct}
  if len(widths) != 1 or any(a1 < b0 for (_, b0), (a1, _) in zip(distinct, distinct[1:])):
    raise ValueError(f"the processes' learner rows {spans} are not equal disjoint blocks")
  return [distinct.index(span) for span in spans]


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """Attributes (`[N]` arrays over the batch's rollouts in group order):
    rows, width: the global batch's shape.
    num_blocks: blocks of `rows // num_blocks` rows (`row_blocks`).
    group_ids, sample_index: which rollout.
    holder: the process that holds its arrays.
    block: the block it is trained in.
    row, start, prompt_length, completion_length, segments, masked,
      advantages: its place and what lies on its tokens (`train_batch.Plan`).
    rewards: its reward.
    forget: `[M, 2]` (group id, copy) that their holders may drop (never
      trained; `held_groups.HeldGroups.forget`).
  """

  rows: int
  width: int
  num_blocks: int
  group_ids: np.ndarray
  sample_index: np.ndarray
  holder: np.ndarray
  block: np.ndarray
  row: np.ndarray
  start: np.ndarray
  prompt_length: np.ndarray
  completion_length: np.ndarray
  segments: np.ndarray
  masked: np.ndarray
  advantages: np.ndarray
  rewards: np.ndarray
  forget: np.ndarray

  @property
  def rows_per_block(self) -> int:
    return self.rows // self.num_blocks

  def batch_plan(self) -> train_batch_lib.Plan:
    return train_batch_lib.Plan(
        layout=packing_lib.Layout(rows=self.rows, width=self.width, row=self.row,
                                  start=self.start),
        advantages=self.advantages, segments=self.segments, masked=self.masked.astype(bool))

  def moved(self, blocks_of_process: list[int]) -> np.ndarray:
    """`[N]` bool: rollout i must leave its holder (a process of its block
    other than the holder needs it)."""
    needs = np.zeros((self.num_blocks, len(blocks_of_process)), bool)
    for process, block in enumerate(blocks_of_process):
      needs[block, process] = True
    others = needs[self.block].copy()
    others[np.arange(len(self.holder)), self.holder] = False
    return others.any(axis=1)

  def to_arrays(self) -> dict[str, np.ndarray]:
    """The plan as four arrays (`from_arrays`), for the lockstep broadcast;
    `forget` padded with (-1, -1) to `padded_count` (a handful of shapes, so
    the broadcast compiles a handful of times)."""
    forget = np.full((padded_count(len(self.forget)), 2), -1, np.int32)
    forget[:len(self.forget)] = np.asarray(self.forget, np.int32).reshape(-1, 2)
    return {"ints": np.stack([np.asarray(getattr(self, n), np.int32) for n in _INT_ROWS]),
            "floats": np.stack([np.asarray(getattr(self, n), np.float32) for n in _FLOAT_ROWS]),
            "forget": forget,
            "shape": np.array([self.rows, self.width, self.num_blocks], np.int32)}

  @staticmethod
  def empty_arrays(rollouts: int, forget: int) -> dict[str, np.ndarray]:
    """Zeros shaped as `to_arrays` of a plan of these sizes."""
    return {"ints": np.zeros((len(_INT_ROWS), rollouts), np.int32),
            "floats": np.zeros((len(_FLOAT_ROWS), rollouts), np.float32),
            "forget": np.zeros((padded_count(forget), 2), np.int32),
            "shape": np.zeros(3, np.int32)}

  @classmethod
  def from_arrays(cls, arrays: dict) -> ShardPlan:
    rows, width, num_blocks = (int(x) for x in arrays["shape"])
    fields = {n: np.asarray(arrays["ints"][k], np.int64) for k, n in enumerate(_INT_ROWS)}
    fields.update({n: np.asarray(arrays["floats"][k], np.float32)
                   for k, n in enumerate(_FLOAT_ROWS)})
    forget = np.asarray(arrays["forget"], np.int64).reshape(-1, 2)
    return cls(rows=rows, width=width, num_blocks=num_blocks,
               forget=forget[forget[:, 0] >= 0], **fields)


def padded_count(count: int) -> int:
  """`count` rounded up to a power of two (at least 8): the rows of a table
  whose length changes every step (`forget`, `shard_batch.collect_held`'s),
  so that its broadcast compiles for a handful of shapes."""
  return max(8, 1 << max(count - 1, 0).bit_length())


def assign(lengths, holder_blocks, *, num_blocks: int, num_slices: int,
           capacity: np.ndarray | None = None, tolerance: int = 0) -> np.ndarray:
  """`[N]` the block each sequence is trained in: its holder's block
  (`holder_blocks`) unless balance needs it elsewhere. Sequence i belongs to
  minibatch `i % num_slices`; each minibatch is balanced on its own.

  Args:
    lengths: `[N]` tokens of each sequence.
    holder_blocks: `[N]` the block of the process that holds it.
    num_blocks: how many blocks.
    num_slices: the update's minibatches.
    capacity: `[num_blocks, num_slices]` exact counts (padded rows,
      `packing.padded_capacity`); None: balance tokens instead.
    tolerance: packed rows: blocks may differ by this many tokens.
  """
  lengths = np.asarray(lengths, np.int64)
  blocks = np.asarray(holder_blocks, np.int64).copy()
  index = np.arange(len(lengths))
  for j in range(num_slices):
    ids = index[index % num_slices == j]
    if capacity is not None:
      _fill_capacity(blocks, ids, capacity[:, j])
    else:
      _balance_tokens(blocks, ids, lengths, num_blocks, tolerance)
  return blocks


def _fill_capacity(blocks, ids, capacity) -> None:
  """Keeps each sequence in its block while the block has room, in order;
  the rest go where room is left (the most first)."""
  left = np.asarray(capacity, np.int64).copy()
  overflow = []
  for i in ids:
    if left[blocks[i]] > 0:
      left[blocks[i]] -= 1
    else:
      overflow.append(i)
  for i in overflow:
    b = int(np.argmax(left))
    if left[b] <= 0:
      raise ValueError(f"{len(ids)} sequences do not fit the blocks' capacity {capacity}")
    blocks[i] = b
    left[b] -= 1


def _balance_tokens(blocks, ids, lengths, num_blocks: int, tolerance: int) -> None:
  """Moves sequences out of the blocks holding more than the mean load plus
  half the `tolerance`, each time the longest that neither overshoots the
  mean by more than half the tolerance nor fills the emptiest block past
  it, into the emptiest block; blocks then end within `tolerance` tokens of
  each other unless single sequences are too long for that. Sorted lengths
  and a heap: O(n log n + moves x n), moves few."""
  load = np.bincount(blocks[ids], weights=lengths[ids], minlength=num_blocks)
  target, slack = load.sum() / num_blocks, tolerance / 2
  receivers = [(load[b], b) for b in range(num_blocks) if load[b] < target + slack]
  heapq.heapify(receivers)
  for donor in np.argsort(-load, kind="stable"):
    if load[donor] <= target + slack:
      break
    mine = sorted(ids[blocks[ids] == donor], key=lambda i: lengths[i])
    sizes = [int(lengths[i]) for i in mine]
    while load[donor] > target + slack and receivers:
      room, receiver = heapq.heappop(receivers)
      if receiver == donor or room != load[receiver]:
        continue  # (a stale heap entry)
      limit = min(load[donor] - target, target - load[receiver]) + slack
      k = bisect.bisect_right(sizes, limit) - 1
      if k < 0:
        heapq.heappush(receivers, (load[receiver], receiver))
        break
      i = mine.pop(k)
      size = sizes.pop(k)
      blocks[i] = receiver
      load[donor] -= size
      load[receiver] += size
      if load[receiver] < target + slack:
        heapq.heappush(receivers, (load[receiver], receiver))


def make(groups, *, blocks_of_process: list[int], prompt_len: int, max_new_tokens: int,
         advantage_estimator: str, mask_truncated_completions: bool,
         packing: packing_lib.Packing | None, num_slices: int, forget=()) -> ShardPlan:
  """The `ShardPlan` of a cut batch's `groups` (full groups are held by this
  process, process 0; `HeldRollout`s by their `holder`), with `forget` (group
  id, copy) passed on to the holders."""
  rollouts = [r for g in groups for r in g.rollouts]
  holder = np.array([0 if r.holder is None else r.holder for r in rollouts], np.int64)
  num_blocks = max(blocks_of_process) + 1
  holder_blocks = np.asarray(blocks_of_process, np.int64)[holder]
  lengths = np.array([r.prompt_length + r.completion_length for r in rollouts], np.int64)
  if packing is None:
    if len(rollouts) % num_blocks:
      raise ValueError(f"{len(rollouts)} padded rows do not split over the {num_blocks} "
                       "learner processes (orchestrator.groups_per_batch x group_size)")
    capacity = packing_lib.padded_capacity(len(rollouts), num_blocks, num_slices)
    blocks = assign(lengths, holder_blocks, num_blocks=num_blocks, num_slices=num_slices,
                    capacity=capacity)
  else:
    blocks = assign(lengths, holder_blocks, num_blocks=num_blocks,
                    num_slices=packing.num_slices, tolerance=packing.pack_len)
  batch_plan = train_batch_lib.plan(
      groups, prompt_len=prompt_len,
      max_new_tokens=train_batch_lib.completion_budget(groups, max_new_tokens, packing),
      advantage_estimator=advantage_estimator,
      mask_truncated_completions=mask_truncated_completions, packing=packing, blocks=blocks,
      num_blocks=num_blocks, num_slices=num_slices)
  layout = batch_plan.layout
  return ShardPlan(
      rows=layout.rows, width=layout.width, num_blocks=num_blocks,
      group_ids=np.array([r.group_id for r in rollouts], np.int64),
      sample_index=np.array([r.sample_index for r in rollouts], np.int64), holder=holder,
      block=blocks, row=layout.row, start=layout.start,
      prompt_length=np.array([r.prompt_length for r in rollouts], np.int64),
      completion_length=np.array([r.completion_length for r in rollouts], np.int64),
      segments=batch_plan.segments, masked=batch_plan.masked, advantages=batch_plan.advantages,
      rewards=np.array([r.reward for r in rollouts], np.float32),
      forget=np.asarray(sorted(forget), np.int64).reshape(-1, 2))
