"""The dispatcher: creates groups, stamps their dispatch version, and applies
flow control, cancellation and requeueing.

Admission follows the AReaL capacity rule: a new group may start only while the
number of groups started and not yet retired (trained, dropped or cancelled)
stays within `(max_async_level + 1) * groups_per_batch`. With
`max_async_level = 0` the sampler can produce exactly one batch ahead of the
learner: the synchronous baseline.

Cancellation: when version `w` is published, every group still in flight that
could only ever train with lag > K (the bound in force, `set_bound`) is
cancelled (see `staleness.can_still_ship`; under `oldest_token` the sampler
reports each group's first sampled version through `note_sampling`).

Pacing (`orchestrator.staleness`, adaptive policy): the capacity follows the
bound in force, `(min(max_async_level, K) + 1) * groups_per_batch`
(`OrchestratorConfig.capacity_at`), so when K tightens fewer groups are
started that could only be dropped; the fixed policy's never changes.

Requeueing (`requeue_dropped = n`): the prompt of a group dropped as stale or
cancelled is dispatched again, ahead of new prompts, up to `n` times, so that
slow (often hard) tasks are not silently lost from training.

Dynamic sampling (`zero_variance.py`): a group whose rewards do not differ
is dropped as it finishes (`drop_finished`, no requeue), and admission counts
a group in flight as the share of groups that are kept (`set_expected_yield`):
the groups that will ship, finished ones plus the expected yield of those in
flight, stay within the capacity, so more are generated at about the same lag.

Reassignment (`reassign`): the groups of a sampler that died start again from
scratch, with their ids and dispatch versions (their lag keeps counting from
the original dispatch), handed out by `take` before anything else; they hold
their admission capacity throughout.

Checkpoints: `work` records every open group at its restart points
(`open_work.py`); `snapshot_work` and `restore_work` carry it, with the prompt
stream's position, across a restart.
"""

from __future__ import annotations

import collections
import heapq
import math
import threading
import time
from collections.abc import Callable, Iterator

from arl_jax.core import group_request as group_request_lib
from arl_jax.core import schedule as schedule_lib
from arl_jax.envs import prompt_codec
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import open_work, orchestrator_config, staleness, work_record


class Dispatcher:
  """Thread-safe source of group requests under admission control."""

  def __init__(self, cfg: orchestrator_config.OrchestratorConfig, prompts: Iterator, encode_fn,
               buffer: buffer_lib.RolloutBuffer, clock: Callable[[], float] = time.monotonic,
               budget_fn: Callable[[object], int | None] | None = None,
               work: open_work.OpenWork | None = None):
    """Args:
      cfg: the orchestrator's settings (the batch's shape, admission,
        staleness, requeues).
      prompts: iterator of prompt records (e.g. from a grain pipeline).
      encode_fn: prompt record -> list of token ids.
      buffer: receives each group's dispatch registration (for FIFO order).
      clock: time source for dispatch timestamps (tests pass a fake one).
      budget_fn: prompt record -> its completion budget, or None for the
        sampler's `max_new_tokens` (see `Environment.max_new_tokens_for`).
      work: the open-work registry this dispatcher opens and closes groups
        in (its orchestrator's); None: a registry of its own.
    """
    self._cfg = cfg
    self._prompts = prompts
    self._encode_fn = encode_fn
    self._budget_fn = budget_fn
    self._buffer = buffer
    self._clock = clock
    self._cond = threading.Condition()
    self._next_group_id = 0
    # The share of in-flight groups expected to ship (dynamic sampling; 1: all).
    self._yield = 1.0
    self._in_system: dict[int, group_request_lib.GroupRequest] = {}  # started, not yet retired
    self._generating: set[int] = set()  # in flight: sampler or environment
    self._oldest_sampled: dict[int, int] = {}  # group_id -> first sampled version
    # (in-flight reference version, group id) of generating groups, as soon as
    # the reference is known: `on_publish` pops the ones that can no longer
    # ship instead of checking every group in flight. Entries of groups that
    # finished, or whose reference changed, stay until they surface (skipped).
    self._by_reference: list[tuple[int, int]] = []
    # Prompts dispatched before new ones: (prompt, ids or None to encode, attempt).
    # Dropped groups' prompts, and after a resume the unfinished ones.
    self._requeued: collections.deque[tuple[object, tuple[int, ...] | None, int]] = (
        collections.deque())
    # Open groups whose sampler was lost, to be generated again (`reassign`).
    self._reassigned: collections.deque[group_request_lib.GroupRequest] = collections.deque()
    # Every open group at its restart points, for checkpoints.
    self.work = work if work is not None else open_work.OpenWork()
    self._closed = False
    self._live_version = 0
    # K in force: cancellation and (adaptive, paced) admission read it.
    self._k = cfg.max_off_policy_steps
    self._capacity = cfg.capacity_at(self._k)
    self.num_started = 0
    self.num_cancelled = 0
    self.num_requeued = 0
    self.num_reassigned = 0
    self.exhausted = False  # the prompt stream has ended
    self.prompts_drawn = 0  # taken from the stream (requeued prompts not counted again)

  def take(self, max_groups: int, live_version: int,
           timeout: float) -> list[group_request_lib.GroupRequest]:
    """Starts up to `max_groups` groups at `live_version`.

    Returns no groups when the caller's `live_version` is older than the newest
    announced by `on_publish` (the caller must swap first, so that a freshly
    freed slot is never spent on old weights), or when no capacity frees up
    within `timeout` seconds.
    """
    requests = []
    with self._cond:
      if not self._cond.wait_for(
          lambda: (self._closed or self._reassigned
                   or self._has_room()), timeout):
        return []
      if live_version < self._live_version:
        return []
      while self._reassigned and len(requests) < max_groups and not self._closed:
        request = self._reassigned.popleft()
        if request.group_id in self._in_system:  # else cancelled while it waited
          requests.append(request)
      while (not self._closed and len(requests) < max_groups
             and self._has_room()):
        if self._requeued:
          prompt, prompt_ids, attempt = self._requeued.popleft()
          if prompt_ids is None:
            prompt_ids = tuple(self._encode_fn(prompt))
        else:
          # Fetch and encode first: if that raises, no group is left registered.
          prompt = next(self._prompts, None)
          if prompt is None:  # a finite stream (data.num_epochs) ran out
            self.exhausted = True
            break
          self.prompts_drawn += 1
          prompt_ids, attempt = tuple(self._encode_fn(prompt)), 0
        requests.append(self._start_locked(prompt, prompt_ids, attempt, live_version))
    return requests

  def _start_locked(self, prompt, prompt_ids, attempt: int,
                    live_version: int) -> group_request_lib.GroupRequest:
    """Opens the next group (under the lock)."""
    budget = self._budget_fn(prompt) if self._budget_fn is not None else None
    if budget is not None and budget < 1:
      raise ValueError(f"prompt {prompt.prompt_id}: completion budget {budget} is < 1")
    request = group_request_lib.GroupRequest(
        group_id=self._next_group_id, prompt=prompt, prompt_ids=prompt_ids,
        dispatch_version=live_version, group_size=self._cfg.group_size,
        dispatch_time=self._clock(), attempt=attempt, max_new_tokens=budget)
    self._next_group_id += 1
    self._in_system[request.group_id] = request
    self._start_generating(request.group_id)
    self._buffer.register_dispatch(request.group_id, live_version)
    self.work.open(request)
    self.num_started += 1
    return request

  def take_recorded(self, group_ids, attempts, live_version: int,
                    timeout: float) -> list[group_request_lib.GroupRequest] | None:
    """A replay's `take` (`sampler/schedule_tap.py`): starts exactly the
    recorded groups, whatever the capacity and the newest version announced
    (the recorded run had room then): requeued prompts for an attempt > 0
    (first, as `take`), the stream's for the rest; None while a requeued
    prompt it needs is not back after `timeout`. Raises
    `schedule.ReplayDiverged` for another group id, attempt or stream end."""
    with self._cond:
      need = sum(1 for a in attempts if a > 0)
      # (closed or not: the recorded run took these before it closed)
      if not self._cond.wait_for(lambda: len(self._requeued) >= need, timeout):
        return None
      requests = []
      for group_id, attempt in zip(group_ids, attempts):
        if group_id != self._next_group_id:
          raise schedule_lib.ReplayDiverged("the next group id", group_id, self._next_group_id)
        if attempt > 0:
          prompt, prompt_ids, requeued = self._requeued.popleft()
          if requeued != attempt:
            raise schedule_lib.ReplayDiverged(f"group {group_id}'s attempt", attempt, requeued)
          prompt_ids = prompt_ids if prompt_ids is not None else tuple(self._encode_fn(prompt))
        else:
          prompt = next(self._prompts, None)
          if prompt is None:
            raise schedule_lib.ReplayDiverged(f"group {group_id}'s prompt", "drawn", "none left")
          self.prompts_drawn += 1
          prompt_ids = tuple(self._encode_fn(prompt))
        requests.append(self._start_locked(prompt, prompt_ids, attempt, live_version))
      return requests

  def free_capacity(self) -> int:
    """How many groups a `take` could start now (reassigned ones included)."""
    with self._cond:
      if self._closed:
        return 0
      generating = len(self._generating)
      room = (self._capacity - (len(self._in_system) - generating)) / self._yield
      return len(self._reassigned) + max(0, math.ceil(room - generating))

  def _has_room(self) -> bool:
    """Admission (under the lock): the groups that will ship, finished ones
    and the expected yield of those in flight, are below the capacity."""
    generating = len(self._generating)
    return (len(self._in_system) - generating + self._yield * generating
            < self._capacity)

  @property
  def expected_yield(self) -> float:
    with self._cond:
      return self._yield

  def set_expected_yield(self, share: float) -> None:
    """The share of in-flight groups expected to ship, in (0, 1] (dynamic
    sampling: the recent kept fraction)."""
    if not 0 < share <= 1:
      raise ValueError(f"expected yield must be in (0, 1], got {share}")
    with self._cond:
      self._yield = float(share)
      self._cond.notify_all()

  @property
  def bound(self) -> int:
    """The staleness bound K in force."""
    with self._cond:
      return self._k

  def set_bound(self, k: int) -> None:
    """Puts staleness bound `k` in force (the orchestrator's, at a publish):
    the next cancellation reads it, and admission's capacity follows it
    (`OrchestratorConfig.capacity_at`). A tighter capacity starts nothing
    until enough groups retire; nothing admitted is taken back here."""
    with self._cond:
      self._k = k
      self._capacity = self._cfg.capacity_at(k)
      self._cond.notify_all()

  def drop_finished(self, group_id: int) -> group_request_lib.GroupRequest | None:
    """Retires a group that finished generating and will not train (dynamic
    sampling), without requeueing its prompt. Returns its request, or None
    when it was cancelled meanwhile (then it is counted as that)."""
    with self._cond:
      if group_id not in self._generating:
        return None
      request = self._in_system.pop(group_id)
      self._generating.discard(group_id)
      self._oldest_sampled.pop(group_id, None)
      self.work.close([group_id])
      self._cond.notify_all()
    self._buffer.forget(group_id)
    return request

  def completion_budget(self, group_id: int, default: int) -> int:
    """The completion budget of an open group's episodes (`group_request_lib.GroupRequest.budget`;
    `default` for a group no longer in the system)."""
    with self._cond:
      request = self._in_system.get(group_id)
    return default if request is None else request.budget(default)

  def note_sampling(self, group_id: int, version: int) -> None:
    """The sampler sampled a token of `group_id` with params of `version`."""
    with self._cond:
      if group_id in self._generating:
        old = self._oldest_sampled.get(group_id)
        if old is None or version < old:
          self._oldest_sampled[group_id] = version
          if self._cfg.staleness_reference == "oldest_token":  # (else fixed at dispatch)
            self._index_reference(group_id)

  def _start_generating(self, group_id: int) -> None:
    self._generating.add(group_id)
    self._index_reference(group_id)

  def _index_reference(self, group_id: int) -> None:
    """Files a generating group under its in-flight reference, once known."""
    reference = staleness.in_flight_reference(self._in_system[group_id].dispatch_version,
                                              self._oldest_sampled.get(group_id),
                                              self._cfg.staleness_reference)
    if reference is not None:
      heapq.heappush(self._by_reference, (reference, group_id))

  def finished_generating(self, group_id: int) -> None:
    with self._cond:
      self._generating.discard(group_id)
      self._oldest_sampled.pop(group_id, None)

  def retire(self, group_ids, dropped: bool = False) -> None:
    """Frees capacity for groups that were trained, or dropped (`dropped=True`:
    stale or cancelled), requeueing dropped prompts as configured."""
    group_ids = list(group_ids)
    with self._cond:
      for gid in group_ids:
        request = self._in_system.pop(gid, None)
        self._generating.discard(gid)
        self._oldest_sampled.pop(gid, None)
        if dropped and request is not None and request.attempt < self._cfg.requeue_dropped:
          self._requeued.append((request.prompt, request.prompt_ids, request.attempt + 1))
          self.num_requeued += 1
      self.work.close(group_ids)
      self._cond.notify_all()

  def reassign(self, group_ids) -> list[int]:
    """Starts the given in-flight groups again from scratch (their sampler was
    lost): the next `take` hands them out first, with their ids and dispatch
    versions. Returns the ids reassigned (those still in flight)."""
    with self._cond:
      waiting = {r.group_id for r in self._reassigned}
      ids = sorted(gid for gid in set(group_ids) if gid in self._generating and gid not in waiting)
      for gid in ids:
        self._oldest_sampled.pop(gid, None)  # its sampled tokens are gone
        self.work.restart(gid)
      self._reassigned.extend(self._in_system[gid] for gid in ids)
      self.num_reassigned += len(ids)
      self._cond.notify_all()
    return ids

  def on_publish(self, live_version: int,
                 forced: list[int] | None = None) -> list[group_request_lib.GroupRequest]:
    """Announces a newly published version; cancels, retires and returns the
    in-flight groups that can no longer ship (a replay: the `forced` ids,
    those the recorded run cancelled)."""
    cfg, heap = self._cfg, self._by_reference
    with self._cond:
      self._live_version = live_version
      doomed, k = {}, self._k
      for gid in forced or ():
        if gid not in self._in_system:
          raise schedule_lib.ReplayDiverged(f"the cancellation at version {live_version}",
                                            f"group {gid} open", "not open")
        doomed[gid] = self._in_system[gid]
      while forced is None and heap and not staleness.can_still_ship(heap[0][0], live_version,
                                                                     k):
        _, gid = heapq.heappop(heap)
        if gid not in self._generating:
          continue
        request = self._in_system[gid]
        reference = staleness.in_flight_reference(
            request.dispatch_version, self._oldest_sampled.get(gid), cfg.staleness_reference)
        if not staleness.can_still_ship(reference, live_version, k):
          doomed[gid] = request
      # No longer generating as of now: a group finishing meanwhile is not
      # also dropped by `drop_finished`.
      self._generating.difference_update(doomed)
      doomed = [doomed[gid] for gid in sorted(doomed)]
    for request in doomed:
      self._buffer.forget(request.group_id)
    self.retire([r.group_id for r in doomed], dropped=True)
    with self._cond:
      self.num_cancelled += len(doomed)
    return doomed

  def snapshot_work(self, partials: dict, exclude=frozenset()) -> work_record.WorkRecord:
    """What a resumed run needs to go on with this dispatcher's work: the
    prompt stream's position, every open group with its episodes at their
    restart points (`open_work.py`; `partials`: the open segments of episodes
    in sampler slots), the requeued prompts and the counters.

    `take` shares this lock, so no group starts between reading the groups
    and the stream position; the caller holds the sampler still meanwhile
    (`SamplerEngine.paused`), so `partials` match the groups read.
    `exclude`: group ids to leave out.
    """
    with self._cond:
      get_state = getattr(self._prompts, "get_state", None)  # a grain iterator's position
      return work_record.WorkRecord(
          prompts_drawn=self.prompts_drawn,
          stream_state=get_state() if get_state is not None else None,
          groups=tuple(self.work.snapshot(partials, exclude, prompt_codec.to_json)),
          requeued=tuple((prompt_codec.to_json(prompt), attempt)
                         for prompt, _, attempt in self._requeued),
          next_group_id=self._next_group_id,
          counters=work_record.WorkCounters(
              started=self.num_started, cancelled=self.num_cancelled,
              requeued=self.num_requeued, reassigned=self.num_reassigned))

  def restore_work(self, work: work_record.WorkRecord) -> list[open_work.RestoredGroup]:
    """Takes back a `snapshot_work` (before any `take`): its groups are open
    again with their ids and dispatch versions (in the buffer's dispatch queue
    in id order, ahead of anything new), its requeued prompts come before new
    ones, and group ids continue after the last one issued. Returns the
    rebuilt groups, for the caller to hand their parts to the sampler, the
    env runner and the buffer."""
    with self._cond:
      if self._next_group_id or self._in_system:
        raise RuntimeError("restore_work must come before any dispatch")
      restored = []
      for record in work.groups:
        prompt = prompt_codec.from_json(record.prompt)
        request = group_request_lib.GroupRequest(
            group_id=record.group_id, prompt=prompt, prompt_ids=record.prompt_ids,
            dispatch_version=record.dispatch_version, group_size=self._cfg.group_size,
            dispatch_time=self._clock(), attempt=record.attempt,
            max_new_tokens=self._budget_fn(prompt) if self._budget_fn is not None else None)
        group = self.work.restore_group(record, request)
        self._in_system[request.group_id] = request
        self._buffer.register_dispatch(request.group_id, request.dispatch_version)
        if group.complete is None:
          if group.oldest_sampled is not None:
            self._oldest_sampled[request.group_id] = group.oldest_sampled
          self._start_generating(request.group_id)
        restored.append(group)
      self._requeued.extend((prompt_codec.from_json(p), None, attempt)
                            for p, attempt in work.requeued)
      self._next_group_id = work.next_group_id
      self.prompts_drawn = work.prompts_drawn
      counters = work.counters
      self.num_started = counters.started
      self.num_cancelled = counters.cancelled
      self.num_requeued = counters.requeued
      self.num_reassigned = counters.reassigned
    return restored

  @property
  def drained(self) -> bool:
    """No prompt is left to dispatch (stream ended, no requeued prompt) and no
    group is in flight: the groups in the buffer are all there will be."""
    with self._cond:
      return self.exhausted and not self._requeued and not self._generating

  @property
  def in_system(self) -> int:
    with self._cond:
      return len(self._in_system)

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()
