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


def padded(prompt_lengths, prompt_len: int, width: int) -> Layout:
  """One sequence per row, its prompt ending at column `prompt_len` (its
  completion then fits in `width - prompt_len` columns)."""
  prompt_lengths = np.asarray(prompt_lengths, np.int64)
  n = len(prompt_lengths)
  return Layout(rows=n, width=width, row=np.arange(n), start=prompt_len - prompt_lengths)


def packed(lengths, packing: Packing) -> Layout:
  """Sequences of `lengths` tokens packed into rows (module docstring)."""
  lengths = np.asarray(lengths, np.int64)
  if not len(lengths) or lengths.min() < 1:
    raise ValueError(f"packing needs one or more non-empty sequences, got lengths {lengths}")
  def cost(layout):
    quadratic = layout.width / packing.attention_width if packing.attention_width else 0.0
    return layout.rows * layout.width * (1.0 + quadratic)

  layouts = [_packed_at(lengths, width, packing)
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


def _packed_at(lengths, width: int, packing: Packing) -> Layout:
  n = packing.num_slices
  slices = [np.arange(j, len(lengths), n) for j in range(n)]
  placed = [first_fit_decreasing(lengths[ids], width) for ids in slices]
  per_slice = row_bucket(max(1, max(used for _, _, used in placed)), packing.row_multiple)
  row = np.zeros(len(lengths), np.int64)
  start = np.zeros(len(lengths), np.int64)
  for j, (ids, (r, s, _)) in enumerate(zip(slices, placed)):
    row[ids] = r * n + j  # slice j's rows are j, j + n, ... (`update._split`)
    start[ids] = s
  return Layout(rows=per_slice * n, width=width, row=row, start=start)
