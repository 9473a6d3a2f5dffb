"""Packing waiting episodes into one prefill."""

import numpy as np

from arl_jax.core import episode as episode_lib
from arl_jax.core import group_request as group_request_lib
from arl_jax.sampler import insert_batch, sampling

PAD = 99


def _episode(group_id, prompt, *, completion=(), open_tokens=(), budget=None, turns=0):
  request = group_request_lib.GroupRequest(group_id=group_id, prompt=f"p{group_id}",
                                        prompt_ids=tuple(prompt), dispatch_version=0,
                                        group_size=1, dispatch_time=0.0, max_new_tokens=budget)
  episode = episode_lib.Episode(request=request, sample_index=0, turns=turns)
  episode.completion_ids = list(completion)
  episode.open_tokens = list(open_tokens)
  episode.open_logprobs = [-0.5] * len(open_tokens)
  episode.open_versions = [3] * len(open_tokens)
  return episode


def test_contexts_are_left_padded_and_rows_padded_to_a_power_of_two():
  items = [(5, _episode(0, [1, 2])),
           (2, _episode(1, [3], completion=[4, 5], open_tokens=[6], budget=6, turns=1)),
           (7, _episode(2, [7, 8, 9]))]
  batch = insert_batch.pack(items, bucket=5, num_slots=8, max_new_tokens=10,
                            pad_id=PAD, stop_mask_fn=lambda request: np.array([True, False]))
  np.testing.assert_array_equal(batch.slots, [5, 2, 7, 7])  # the last row repeated
  np.testing.assert_array_equal(batch.tokens, [[PAD, PAD, PAD, 1, 2], [PAD, 3, 4, 5, 6],
                                               [PAD, PAD, 7, 8, 9], [PAD, PAD, 7, 8, 9]])
  np.testing.assert_array_equal(batch.mask, batch.tokens != PAD)
  # The open segment is the end of its context, with its recorded numbers.
  np.testing.assert_array_equal(batch.open_len, [0, 1, 0, 0])
  np.testing.assert_array_equal(batch.open_logprobs[1], np.float32([0, 0, 0, 0, -0.5]))
  np.testing.assert_array_equal(batch.open_versions[1], [-1, -1, -1, -1, 3])
  assert np.all(batch.open_logprobs[[0, 2, 3]] == 0)
  assert np.all(batch.open_versions[[0, 2, 3]] == sampling.NO_VERSION)
  # Budgets count every completion token held (the open one included).
  np.testing.assert_array_equal(batch.max_new, [10, 6 - 3, 10, 10])
  np.testing.assert_array_equal(batch.stop_mask, [[True, False]] * 4)
  # (group id, sample index, turn): the insert derives each row's key from them.
  np.testing.assert_array_equal(batch.key_ids, [[0, 0, 0], [1, 0, 1], [2, 0, 0], [2, 0, 0]])
  assert batch.key_ids.dtype == np.uint32
  assert len(batch.args()) == 9 and batch.args()[0] is batch.slots


def test_abstract_describes_what_pack_gives():
  items = [(1, _episode(0, [1, 2])), (3, _episode(1, [3], open_tokens=[6]))]
  batch = insert_batch.pack(items, bucket=5, num_slots=8, max_new_tokens=10, pad_id=PAD,
                            stop_mask_fn=lambda request: np.array([True, False, True]))
  want = insert_batch.abstract(2, 5, num_stop_ids=3)
  for got, spec in zip(batch.args(), want.args(), strict=True):
    assert (got.shape, got.dtype) == (spec.shape, spec.dtype)
