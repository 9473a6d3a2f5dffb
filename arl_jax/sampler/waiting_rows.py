"""`WaitingRows`: the episode segments waiting for a sampler slot, in admission order.

Three kinds of work wait: new requests, episodes a checkpoint left (restored
before the engine starts) and multi-turn episodes that env workers hand back
on their own threads. Handed-back episodes go ahead of the rest: they are
older work, and finishing them first keeps their lag down. A cancelled group
loses its waiting rows at once, and any of its episodes that comes back later.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from arl_jax.core import episode as episode_lib


@dataclasses.dataclass
class Row:
  """An episode's segment waiting for, or occupying, a slot."""

  episode: episode_lib.Episode
  ready_time: float  # when it started waiting for a slot
  version: int = -1  # version the segment started on (pinned mode decodes it with that)
  start_time: float = 0.0
  budget: int = 0  # tokens this segment may sample
  sampled: int = 0  # tokens sampled so far (the first by the insert)
  first_column: int = 0  # column of its first sampled token (its context's length)

  @property
  def last_column(self) -> int:
    """The column of the last token it sampled (in a slot): the next decode
    step writes that token's keys and values there."""
    return self.first_column + self.sampled - 1

  @property
  def group_id(self) -> int:
    return self.episode.group_id


class WaitingRows:
  """The queue of rows waiting for a slot. `resume` is thread-safe; the other
  methods belong to the engine thread (or to the caller before it starts)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._resumed: list[Row] = []  # handed back by env workers, under _lock
    self._queue: collections.deque[Row] = collections.deque()
    # Cancelled group ids: an episode of one may still come back from an env worker.
    self._cancelled: set[int] = set()

  def __len__(self) -> int:
    """Rows queued (handed-back rows count once `take_resumed` queued them)."""
    return len(self._queue)

  @property
  def handed_back(self) -> int:
    """Rows handed back and not yet queued by `take_resumed` (thread-safe)."""
    with self._lock:
      return len(self._resumed)

  def resume(self, row: Row) -> None:
    """Hands back a row from another thread; it is queued by `take_resumed`."""
    with self._lock:
      self._resumed.append(row)

  def append(self, row: Row) -> None:
    """Queues `row` behind the rows waiting already."""
    self._queue.append(row)

  def __iter__(self):
    """The queued rows, front first."""
    return iter(list(self._queue))

  def push_front(self, rows) -> None:
    """Queues `rows` (in their order) ahead of every waiting row: admissions
    that did not fit, and preempted rows, which are the oldest work."""
    self._queue.extendleft(reversed(list(rows)))

  def extend(self, rows) -> None:
    """Queues `rows` behind the rows waiting already."""
    self._queue.extend(rows)

  def pop(self, n: int) -> list[Row]:
    """Up to `n` rows from the front of the queue."""
    return [self._queue.popleft() for _ in range(min(n, len(self._queue)))]

  def take_resumed(self) -> list[Row]:
    """Queues the handed-back rows ahead of the others, in the order they came
    back; returns those of cancelled groups, dropped instead."""
    with self._lock:
      resumed, self._resumed = self._resumed, []
    dropped = []
    for row in reversed(resumed):
      if row.group_id in self._cancelled:
        dropped.append(row)
      else:
        self._queue.appendleft(row)
    return dropped

  def cancel(self, group_ids: set[int]) -> list[Row]:
    """Drops the rows of `group_ids`, now and whenever one comes back; returns
    those dropped now."""
    self._cancelled |= group_ids
    dropped = self.take_resumed()
    kept = collections.deque()
    for row in self._queue:
      (dropped if row.group_id in group_ids else kept).append(row)
    self._queue = kept
    return dropped
