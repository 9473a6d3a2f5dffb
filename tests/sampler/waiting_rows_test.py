"""The queue of episodes waiting for a sampler slot."""

import threading

from arl_jax.core import episode as episode_lib
from arl_jax.core import group_request as group_request_lib
from arl_jax.sampler import waiting_rows


def _row(group_id, sample_index=0):
  request = group_request_lib.GroupRequest(group_id=group_id, prompt=None, prompt_ids=(1,),
                                        dispatch_version=0, group_size=2, dispatch_time=0.0)
  episode = episode_lib.Episode(request=request, sample_index=sample_index)
  return waiting_rows.Row(episode=episode, ready_time=0.0)


def _ids(rows):
  return [(r.group_id, r.episode.sample_index) for r in rows]


def test_handed_back_rows_go_ahead_in_the_order_they_came_back():
  waiting = waiting_rows.WaitingRows()
  waiting.extend([_row(0), _row(0, 1)])
  threads = [threading.Thread(target=waiting.resume, args=(_row(g),)) for g in (7, 8)]
  for t in threads:
    t.start()
    t.join()
  assert len(waiting) == 2  # handed back, not queued yet
  assert waiting.take_resumed() == []
  assert _ids(waiting.pop(3)) == [(7, 0), (8, 0), (0, 0)]
  assert _ids(waiting.pop(3)) == [(0, 1)] and not waiting


def test_cancelled_groups_lose_waiting_rows_now_and_handed_back_rows_later():
  waiting = waiting_rows.WaitingRows()
  waiting.extend([_row(0), _row(1), _row(0, 1)])
  waiting.resume(_row(0, 1))
  assert _ids(waiting.cancel({0})) == [(0, 1), (0, 0), (0, 1)]
  assert _ids(waiting.pop(5)) == [(1, 0)]
  waiting.resume(_row(0))
  waiting.resume(_row(2))
  assert _ids(waiting.take_resumed()) == [(0, 0)]
  assert _ids(waiting.pop(5)) == [(2, 0)]
