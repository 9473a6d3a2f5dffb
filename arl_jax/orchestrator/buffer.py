"""The rollout buffer: finished groups wait here until a batch is cut.

It enforces the staleness guarantee: every attempt to cut a batch first drops
each group whose lag in that batch would exceed K. It also implements the batch
assembly policies:

- `fifo`: dispatch order; the batch waits for the oldest dispatched group.
- `windowed_fifo`: a finished group may be taken out of dispatch order only
  while it is among the first `window` groups of the dispatch queue (MiniMax
  Forge uses 30% of a batch), so slow groups inside the window hold the batch.
- `first_done`: completion order (biased toward short, easy tasks; kept for
  comparison).

Bounded by admission control rather than by a size of its own: the dispatcher
never lets more than `(max_async_level + 1) * groups_per_batch` groups be in
the system, and every group in the buffer is one of them.

Every operation costs what it touches, not what the system holds (thousands
of groups in flight at pod scale; `benchmarks/data_plane.py` part
`orchestrator`): the queues are insertion-ordered dicts (O(1) removal), a cut
reads only the head of the queue it assembles from, and the sweep pops stale
groups off a heap ordered by reference version instead of checking them all.

Thread-safe (env workers put groups, the learner cuts) and deterministic given
the order of calls: cuts never block here (`try_cut`); the caller waits with
`wait_for_change` (see `orchestrator.Orchestrator.cut`). Time comes from an
injectable clock so tests can drive the buffer with a fake one.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading
import time
from collections.abc import Callable

from arl_jax.core import rollout as rollout_lib
from arl_jax.orchestrator import orchestrator_config, staleness


@dataclasses.dataclass
class CutResult:
  """One cut attempt: the batch's groups (`None` if no full batch was
  eligible) and the groups the sweep before it dropped as stale."""

  batch_version: int
  groups: list[rollout_lib.Group] | None
  stale: list[rollout_lib.Group]


class BufferClosed(Exception):
  """Raised when the buffer is closed while a batch is awaited."""


class RolloutBuffer:
  """Finished groups, the dispatch queue, and the batch cut."""

  def __init__(self, cfg: orchestrator_config.OrchestratorConfig,
               clock: Callable[[], float] = time.monotonic):
    """`cfg`: reads the staleness bound and reference, the assembly policy
    and its window."""
    self._cfg = cfg
    self._clock = clock
    self._cond = threading.Condition()
    self._k = cfg.max_off_policy_steps  # K in force (`set_bound`)
    # group_id -> dispatch version, in dispatch order (dicts keep insertion order).
    self._dispatch_queue: dict[int, int] = {}
    # Finished groups, in completion order.
    self._finished: dict[int, rollout_lib.Group] = {}
    self._arrival_time: dict[int, float] = {}
    # (reference version, arrival number, group id) of finished groups; entries
    # of groups that left the buffer stay until they surface (then skipped).
    self._by_reference: list[tuple[int, int, int]] = []
    self._arrivals = itertools.count()
    self._generation = 0  # bumped by every change a waiting cut may care about
    self.closed = False

  def register_dispatch(self, group_id: int, dispatch_version: int) -> None:
    with self._cond:
      self._dispatch_queue[group_id] = dispatch_version
      self._changed_locked()

  def set_bound(self, k: int) -> None:
    """Puts staleness bound `k` in force for the sweeps of later cuts (the
    orchestrator's, at a publish)."""
    with self._cond:
      self._k = k

  def forget(self, group_id: int) -> None:
    """Removes a cancelled group, whether it is still to arrive or already here."""
    with self._cond:
      self._dispatch_queue.pop(group_id, None)
      if self._finished.pop(group_id, None) is not None:
        self._arrival_time.pop(group_id)
      self._changed_locked()

  def put(self, group: rollout_lib.Group, live_version: int) -> bool:
    """Adds a finished group, stamping the version live on arrival.

    Returns False (and keeps nothing) when the group was cancelled while its
    last rollout was being scored.
    """
    with self._cond:
      if group.group_id not in self._dispatch_queue:
        return False
      group.arrival_version = live_version
      self._finished[group.group_id] = group
      self._arrival_time[group.group_id] = self._clock()
      reference = staleness.reference_version(group, self._cfg.staleness_reference)
      heapq.heappush(self._by_reference, (reference, next(self._arrivals), group.group_id))
      self._changed_locked()
      return True

  def close(self) -> None:
    with self._cond:
      self.closed = True
      self._changed_locked()

  def __len__(self) -> int:
    with self._cond:
      return len(self._finished)

  @property
  def generation(self) -> int:
    with self._cond:
      return self._generation

  def wait_for_change(self, generation: int, timeout: float) -> bool:
    """Blocks until something changed since `generation`; False on timeout."""
    with self._cond:
      return self._cond.wait_for(lambda: self._generation != generation, timeout)

  def try_cut(self, batch_version: int, num_groups: int) -> CutResult:
    """Sweeps stale groups, then takes a batch if the policy has one ready.

    The sweep runs on every attempt, so a batch never contains a group whose
    lag in `B_{batch_version}` exceeds K, however long it waited.
    """
    with self._cond:
      stale = self._sweep_locked(batch_version)
      chosen = self._select_locked(num_groups)
      groups = None if chosen is None else [self._pop_locked(gid) for gid in chosen]
      if stale or groups:
        self._changed_locked()
      return CutResult(batch_version=batch_version, groups=groups, stale=stale)

  def take_exactly(self, batch_version: int, stale_ids, group_ids) -> CutResult | None:
    """A replay's cut: pops the recorded `stale_ids` and the batch's
    `group_ids` (None: no batch) in their order, once every one of them has
    arrived (None until then)."""
    with self._cond:
      wanted = list(stale_ids) + list(group_ids or ())
      if not all(gid in self._finished for gid in wanted):
        return None
      stale = [self._pop_locked(gid) for gid in stale_ids]
      groups = None if group_ids is None else [self._pop_locked(gid) for gid in group_ids]
      if stale or groups:
        self._changed_locked()
      return CutResult(batch_version=batch_version, groups=groups, stale=stale)

  def _changed_locked(self) -> None:
    self._generation += 1
    self._cond.notify_all()

  def _sweep_locked(self, batch_version: int) -> list[rollout_lib.Group]:
    """Pops the groups whose lag in `B_{batch_version}` would exceed K, in
    completion order: those at the top of the reference-version heap."""
    heap, k = self._by_reference, self._k
    stale = []  # (arrival number, group id)
    while heap and batch_version - heap[0][0] > k:
      _, arrival, gid = heapq.heappop(heap)
      group = self._finished.get(gid)
      if group is not None and staleness.is_stale(batch_version, group, k,
                                                  self._cfg.staleness_reference):
        stale.append((arrival, gid))
    return [self._pop_locked(gid) for _, gid in sorted(stale)]

  def _pop_locked(self, group_id: int) -> rollout_lib.Group:
    group = self._finished.pop(group_id)
    self._dispatch_queue.pop(group_id, None)
    waited = self._clock() - self._arrival_time.pop(group_id)
    for r in group.rollouts:
      r.timings["in_buffer"] = waited
    return group

  def _select_locked(self, num_groups: int) -> list[int] | None:
    if len(self._finished) < num_groups:
      return None
    policy = self._cfg.assembly
    if policy == "first_done":
      return list(itertools.islice(self._finished, num_groups))
    if policy == "fifo":
      head = list(itertools.islice(self._dispatch_queue, num_groups))
      return head if all(gid in self._finished for gid in head) else None
    # windowed_fifo: repeatedly take the oldest finished group within the first
    # `window` entries of the (shrinking) dispatch queue; no pick reaches past
    # the first `window + num_groups` entries.
    queue = list(itertools.islice(self._dispatch_queue, self._cfg.window_groups + num_groups))
    chosen = []
    while len(chosen) < num_groups:
      window = queue[:self._cfg.window_groups]
      pick = next((gid for gid in window if gid in self._finished), None)
      if pick is None:
        return None
      chosen.append(pick)
      queue.remove(pick)
    return chosen
