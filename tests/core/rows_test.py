"""Packing sequences into fixed-width rows."""

import numpy as np
import pytest

from arl_jax.core import rows as rows_lib


def test_left_pad_ends_every_sequence_at_the_last_column():
  values, mask = rows_lib.left_pad([[1, 2], [], [3, 4, 5]], 3, fill=9)
  np.testing.assert_array_equal(values, [[9, 1, 2], [9, 9, 9], [3, 4, 5]])
  np.testing.assert_array_equal(mask, [[False, True, True], [False] * 3, [True] * 3])
  assert values.dtype == np.int32 and mask.dtype == bool


def test_right_pad_starts_every_sequence_at_the_first_column():
  values, mask = rows_lib.right_pad([np.array([0.5, 0.25]), [1.0]], 4, fill=0.0,
                                    dtype=np.float32)
  np.testing.assert_array_equal(values, np.float32([[0.5, 0.25, 0, 0], [1.0, 0, 0, 0]]))
  np.testing.assert_array_equal(mask, [[True, True, False, False], [True, False, False, False]])
  assert values.dtype == np.float32


def test_values_are_cast_to_the_row_dtype():
  values, _ = rows_lib.left_pad([np.float64([0.1, 0.2])], 3, fill=0.0, dtype=np.float32)
  np.testing.assert_array_equal(values[0, 1:], np.float32([0.1, 0.2]))


def test_no_rows_gives_empty_arrays_of_the_width():
  values, mask = rows_lib.left_pad([], 5, fill=0)
  assert values.shape == mask.shape == (0, 5)


@pytest.mark.parametrize("pad", [rows_lib.left_pad, rows_lib.right_pad])
def test_a_sequence_longer_than_the_row_is_an_error(pad):
  with pytest.raises(ValueError, match="row 1 holds 4 values; rows are 3 wide"):
    pad([[1], [1, 2, 3, 4]], 3, fill=0)
