"""`Episode`'s bookkeeping of a segment's alternatives (top log-probs): an
open segment's join the ones its slot read when the segment ends, and a
dropped tail drops theirs."""

import numpy as np
import pytest

from arl_jax.core import episode as episode_lib
from arl_jax.core import group_request


def _episode():
  request = group_request.GroupRequest(group_id=3, prompt=None, prompt_ids=(1, 2),
                                       group_size=1, dispatch_version=0, dispatch_time=0.0)
  return episode_lib.Episode(request=request, sample_index=0)


def _alternatives(first_id, n, k=2):
  ids = np.arange(first_id, first_id + n * k, dtype=np.int32).reshape(n, k)
  return ids, -ids.astype(np.float32)


def test_an_open_segment_s_alternatives_replace_the_rows_its_slot_never_sampled():
  episode = _episode()
  episode.open_tokens, episode.open_logprobs, episode.open_versions = [5, 6], [-1.0, -1.0], [0, 0]
  episode.open_alternatives = _alternatives(100, 2)
  read = _alternatives(0, 4)
  read[0][:2], read[1][:2] = -1, -np.inf  # (the slot's rows for the open tokens)
  episode.add_segment([5, 6, 7, 8], [-1.0] * 4, [0] * 4, stopped=True, alternatives=read)
  ids, logps = episode.last_alternatives
  np.testing.assert_array_equal(ids[:2], _alternatives(100, 2)[0])
  np.testing.assert_array_equal(ids[2:], read[0][2:])
  np.testing.assert_array_equal(logps, -ids.astype(np.float32))
  assert episode.open_alternatives is None


def test_a_dropped_tail_drops_its_alternatives_and_none_stay_none():
  episode = _episode()
  episode.add_segment([5, 6, 7], [-1.0] * 3, [0] * 3, stopped=True,
                      alternatives=_alternatives(0, 3))
  episode.drop_sampled_tail(2)
  assert episode.completion_ids == [5] and len(episode.last_alternatives[0]) == 1
  episode.add_observation([9])
  episode.add_segment([10], [-0.5], [1], stopped=False)
  assert episode.last_alternatives is None


def test_segments_check_their_lengths():
  with pytest.raises(ValueError, match="3 tokens has 2 log-probs"):
    _episode().add_segment([1, 2, 3], [0.0, 0.0], [0, 0, 0], stopped=False)
