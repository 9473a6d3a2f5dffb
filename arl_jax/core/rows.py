"""Packing variable-length sequences into fixed-width rows.

Every array a jitted function consumes has a fixed width (a prompt bucket, a
completion budget), so the host pads sequences into rows first. Prompts and
contexts are left-padded: they end at the same column, where the completion
starts, which is what lets the sampler and the learner see the same columns,
masks and positions. Completions are right-padded after that column.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def left_pad(sequences: Sequence[Sequence], width: int, fill, dtype=np.int32):
  """Right-aligns each sequence in a row of `width` columns.

  Args:
    sequences: R sequences of at most `width` values each.
    width: columns of a row.
    fill: the value of the columns no sequence covers.
    dtype: dtype of the values array (sequences are cast to it).

  Returns:
    `(values [R, width] dtype, mask [R, width] bool)`: row i holds sequence i
    in its last `len(sequences[i])` columns, where `mask` is True.

  Raises:
    ValueError: a sequence longer than `width`.
  """
  return _pad(sequences, width, fill, dtype, left=True)


def right_pad(sequences: Sequence[Sequence], width: int, fill, dtype=np.int32):
  """Left-aligns each sequence in a row of `width` columns (see `left_pad`):
  row i holds sequence i in its first `len(sequences[i])` columns."""
  return _pad(sequences, width, fill, dtype, left=False)


def _pad(sequences, width: int, fill, dtype, *, left: bool):
  values = np.full((len(sequences), width), fill, dtype)
  mask = np.zeros((len(sequences), width), bool)
  for i, seq in enumerate(sequences):
    n = len(seq)
    # A longer sequence would wrap around: a negative start column indexes
    # from the end and would silently overwrite the row.
    if n > width:
      raise ValueError(f"row {i} holds {n} values; rows are {width} wide")
    cols = slice(width - n, width) if left else slice(0, n)
    values[i, cols] = seq
    mask[i, cols] = True
  return values, mask
