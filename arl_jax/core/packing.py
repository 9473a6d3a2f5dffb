"""Where each rollout of a batch lies in the learner's rows: padded or packed.

Padded rows (`padded`) hold one rollout each, its prompt ending at column
`prompt_len` as in the sampler: every row is as wide as the batch's longest
completion, so on long-tailed lengths most trained columns are padding.
Packed rows (`packed`) hold several rollouts each, one after another from
column 0 with no padding between them; the learner tells them apart by their
segment ids (no token attends across rollouts, positions restart at 0).

The packer is first-fit decreasing (longest rollout first, into the first row
with room; at most 11/9 of the optimal row count plus one). A batch's packed
width is chosen among a handful, so that the jitted update compiles once per
width and row count, not per batch: `pack_len` halved while the longest
rollout still fits (or the power of two that holds a longer one), the width
whose rows cost the least winning. A row of W columns costs W tokens' matmuls
plus attention over W x W scores (the XLA attention computes every pair, and
masks): `W (1 + W / attention_width)`, `attention_width` the width at which
the two are equal (`attention_width`: ~1,500 for a 3M-parameter model, ~35k
for a 7B one). Row counts are rounded up to `row_multiple` times
1, 2, 3, 4, 6, 8, 12, ... (at most a third wasted).

Minibatches stay what they are unpacked: with `num_slices = n` the rollouts
`j, j + n, j + 2n, ...` (unpacked minibatch j) are packed on their own into
rows `j, j + n, j + 2n, ...`, the rows the update takes as minibatch j, so
packing changes no optimizer step's data.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Packing:
  """How `train_batch.assemble` lays out rollouts (None there: padded rows).

  Attributes:
    pack_len: the widest packed row of a batch whose rollouts all fit in it;
      a longer rollout widens its batch's rows to the power of two holding it.
    num_slices: minibatches of the update; each is packed on its own.
    row_multiple: each slice's rows are a multiple of this (microbatches x
      the learner's data shards), so that every slice splits evenly.
    attention_width: the row width at which the model's attention over a
      row costs as much as the rest of it (`attention_width`; 0: attention
      is not counted when choosing a width).
  """

  pack_len: int
  num_slices: int = 1
  row_multiple: int = 1
  attention_width: float = 0.0

  def __post_init__(self):
    for name in ("pack_len", "num_slices", "row_multiple"):
      if getattr(self, name) < 1:
        raise ValueError(f"Packing.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class Layout:
  """`rows x width` columns; sequence i lies in row `row[i]` from column
  `start[i]` (sequences sharing a row never overlap)."""

  rows: int
  width: int
  row: np.ndarray  # [N] int
  start: np.ndarray  # [N] int


def padded(prompt_lengths, prompt_len: int, width: int, *, blocks=None, num_blocks: int = 1,
           num_slices: int = 1) -> Layout:
  """One sequence per row, its prompt ending at column `prompt_len` (its
  completion then fits in `width - prompt_len` columns). Sequence i lies in
  row i; with `blocks` (sequence i in block `blocks[i]` of `num_blocks`
  equal blocks of consecutive rows: a learner process's shard), in the
  next row of its block that belongs to its minibatch (row r is in slice
  `r % num_slices`, as sequence i is in slice `i % num_slices`): each block
  must be given exactly its rows' count of each slice (`padded_capacity`)."""
  prompt_lengths = np.asarray(prompt_lengths, np.int64)
  n = len(prompt_lengths)
  start = prompt_len - prompt_lengths
  if blocks is None:
    return Layout(rows=n, width=width, row=np.arange(n), start=start)
  blocks = np.asarray(blocks, np.int64)
  if np.any(np.bincount(blocks, minlength=num_blocks) * num_blocks != n):
    raise ValueError(f"{n} padded rows in {num_blocks} blocks: got "
                     f"{np.bincount(blocks, minlength=num_blocks).tolist()} sequences per block")
  per_block = n // num_blocks
  row = np.zeros(n, np.int64)
  for b in range(num_blocks):
    rows = np.arange(b * per_block, (b + 1) * per_block)
    for j in range(num_slices):
      ids = np.flatnonzero((blocks == b) & (np.arange(n) % num_slices == j))
      free = rows[rows % num_slices == j]
      if len(ids) != len(free):
        raise ValueError(f"block {b} has {len(free)} rows of minibatch {j}, given {len(ids)} "
                         "sequences (padded_capacity)")
      row[ids] = free
  return Layout(rows=n, width=width, row=row, start=start)


def padded_capacity(rows: int, num_blocks: int, num_slices: int) -> np.ndarray:
  """`[num_blocks, num_slices]`: how many of `padded`'s rows block b holds
  of minibatch j (`rows` divides into the blocks)."""
  per_block = rows // num_blocks
  index = np.arange(rows)
  return np.array([[np.sum((index // per_block == b) & (index % num_slices == j))
                    for j in range(num_slices)] for b in range(num_blocks)], np.int64)


def packed(lengths, packing: Packing, *, blocks=None, num_blocks: int = 1) -> Layout:
  """Sequences of `lengths` tokens packed into rows (module docstring). With
  `blocks`, sequence i goes into block `blocks[i]` of `num_blocks` equal
  blocks of consecutive rows (a learner process's shard): each block's
  minibatches are packed on their own, into as many rows as the fullest
  needs."""
  lengths = np.asarray(lengths, np.int64)
  if not len(lengths) or lengths.min() < 1:
    raise ValueError(f"packing needs one or more non-empty sequences, got lengths {lengths}")
  def cost(layout):
    quadratic = layout.width / packing.attention_width if packing.attention_width else 0.0
    return layout.rows * layout.width * (1.0 + quadratic)

  blocks = np.zeros(len(lengths), np.int64) if blocks is None else np.asarray(blocks, np.int64)
  layouts = [_packed_at(lengths, width, packing, blocks, num_blocks)
             for width in candidate_widths(int(lengths.max()), packing.pack_len)]
  return min(layouts, key=cost)  # the widest of equal costs: fewer rows


def attention_width(model) -> float:
  """The row width at which a decoder's (`ModelConfig`'s) attention FLOPs
  over a row equal its matmuls': per token, `2 x params` against
  `4 x layers x heads x head_dim x width` (the learner benchmark's model)."""
  return model.num_params / (2 * model.num_layers * model.num_heads * model.head_dim)


def candidate_widths(longest: int, pack_len: int) -> list[int]:
  """Row widths a batch whose longest sequence has `longest` tokens may use:
  `pack_len, pack_len / 2, ...` down to the last that holds it, or only the
  power of two that holds it when it is longer than `pack_len`."""
  if longest > pack_len:
    return [1 << (int(longest) - 1).bit_length()]
  widths = [pack_len]
  while widths[-1] % 2 == 0 and widths[-1] // 2 >= longest:
    widths.append(widths[-1] // 2)
  return widths


def row_bucket(rows: int, multiple: int) -> int:
  """`rows` rounded up to `multiple` x the next of 1, 2, 3, 4, 6, 8, 12, 16, ..."""
  units = -(-rows // multiple)
  bucket = 1
  while bucket < units:  # a power of two p is followed by 3p / 2, that by 2p
    power = bucket & (bucket - 1) == 0
    bucket = bucket + 1 if bucket < 2 else (bucket * 3 // 2 if power else bucket * 4 // 3)
  return bucket * multiple


def first_fit_decreasing(lengths, width: int) -> tuple[np.ndarray, np.ndarray, int]:
  """`(row [N], start [N], rows)`: each sequence, longest first, goes into the
  first row with room; within a row sequences follow in placement order."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.max(initial=0) > width:
    raise ValueError(f"a sequence of {lengths.max()} tokens does not fit rows of {width}")
  free = np.full(len(lengths), width, np.int64)  # at most one row per sequence
  row = np.zeros(len(lengths), np.int64)
  start = np.zeros(len(lengths), np.int64)
  used = 0
  for i in np.argsort(-lengths, kind="stable"):
    fits = np.flatnonzero(free[:used] >= lengths[i])
    r = int(fits[0]) if len(fits) else used
    used = max(used, r + 1)
    row[i], start[i] = r, width - free[r]
    free[r] -= lengths[i]
  return row, start, used


def utilisation(lengths, layout: Layout) -> float:
  """The share of the layout's columns that hold a token."""
  return float(np.sum(lengths)) / max(layout.rows * layout.width, 1)


def _packed_at(lengths, width: int, packing: Packing, blocks, num_blocks: int) -> Layout:
  n = packing.num_slices
  sliced = np.arange(len(lengths)) % n
  cells = [(b, j, np.flatnonzero((blocks == b) & (sliced == j)))
           for b in range(num_blocks) for j in range(n)]
  placed = [first_fit_decreasing(lengths[ids], width) if len(ids) else (ids, ids, 0)
            for _, _, ids in cells]
  # Each block's share of a slice's rows splits evenly over its devices and
  # the microbatches when the blocks split `row_multiple`.
  multiple = packing.row_multiple
  if multiple % num_blocks == 0:
    multiple //= num_blocks
  per_cell = row_bucket(max(1, max(used for _, _, used in placed)), multiple)
  row = np.zeros(len(lengths), np.int64)
  start = np.zeros(len(lengths), np.int64)
  for (b, j, ids), (r, s, _) in zip(cells, placed):
    # Slice j's rows are j, j + n, ... (`update._split`), in each block.
    row[ids] = b * per_cell * n + r * n + j
    start[ids] = s
  return Layout(rows=per_cell * n * num_blocks, width=width, row=row, start=start)
