"""The dispatcher: creates groups, stamps their dispatch version, and applies
flow control and cancellation.

Admission follows the AReaL capacity rule: a new group may start only while the
number of groups started and not yet retired (trained, dropped or cancelled)
stays within `(max_async_level + 1) * groups_per_batch`. With
`max_async_level = 0` the sampler can produce exactly one batch ahead of the
learner: the synchronous baseline.

Cancellation: when version `w` is published, every group still generating that
could only ever train with lag > K is cancelled (see `staleness.can_still_ship`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator

from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import staleness


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchConfig:
  group_size: int
  groups_per_batch: int
  max_async_level: int = 1
  max_off_policy_steps: int = 8

  @property
  def capacity(self) -> int:
    return (self.max_async_level + 1) * self.groups_per_batch


@dataclasses.dataclass(frozen=True)
class GroupRequest:
  """What the sampler needs to generate one group."""

  group_id: int
  prompt: object  # the environment's prompt record
  prompt_ids: tuple[int, ...]
  dispatch_version: int
  group_size: int
  dispatch_time: float


class Dispatcher:
  """Thread-safe source of group requests under admission control."""

  def __init__(self, cfg: DispatchConfig, prompts: Iterator, encode_fn,
               buffer: buffer_lib.RolloutBuffer):
    """Args:
      cfg: dispatch settings.
      prompts: iterator of prompt records (e.g. from a grain pipeline).
      encode_fn: prompt record -> list of token ids.
      buffer: receives each group's dispatch registration (for FIFO order).
    """
    self._cfg = cfg
    self._prompts = prompts
    self._encode_fn = encode_fn
    self._buffer = buffer
    self._cond = threading.Condition()
    self._next_group_id = itertools.count()
    self._in_system: set[int] = set()  # started, not yet retired
    self._generating: dict[int, int] = {}  # group_id -> dispatch version
    self._closed = False
    self._live_version = 0
    self.num_started = 0
    self.num_cancelled = 0

  def take(self, max_groups: int, live_version: int, timeout: float) -> list[GroupRequest]:
    """Starts up to `max_groups` groups at `live_version`.

    Returns no groups when the caller's `live_version` is older than the newest
    announced by `on_publish` (the caller must swap first, so that a freshly
    freed slot is never spent on old weights), or when no capacity frees up
    within `timeout` seconds.
    """
    requests = []
    with self._cond:
      if not self._cond.wait_for(
          lambda: self._closed or len(self._in_system) < self._cfg.capacity, timeout):
        return []
      if live_version < self._live_version:
        return []
      while (not self._closed and len(requests) < max_groups
             and len(self._in_system) < self._cfg.capacity):
        # Fetch and encode first: if that raises, no group is left registered.
        prompt = next(self._prompts)
        prompt_ids = tuple(self._encode_fn(prompt))
        group_id = next(self._next_group_id)
        self._in_system.add(group_id)
        self._generating[group_id] = live_version
        self._buffer.register_dispatch(group_id, live_version)
        self.num_started += 1
        requests.append(GroupRequest(
            group_id=group_id, prompt=prompt, prompt_ids=prompt_ids,
            dispatch_version=live_version, group_size=self._cfg.group_size,
            dispatch_time=time.monotonic()))
    return requests

  def finished_generating(self, group_id: int) -> None:
    with self._cond:
      self._generating.pop(group_id, None)

  def retire(self, group_ids) -> None:
    """Frees capacity for groups that were trained, dropped or cancelled."""
    with self._cond:
      for gid in group_ids:
        self._in_system.discard(gid)
        self._generating.pop(gid, None)
      self._cond.notify_all()

  def on_publish(self, live_version: int) -> list[int]:
    """Announces a newly published version; cancels and returns the generating
    groups that can no longer ship."""
    with self._cond:
      self._live_version = live_version
      doomed = [gid for gid, dv in self._generating.items()
                if not staleness.can_still_ship(dv, live_version, self._cfg.max_off_policy_steps)]
    for gid in doomed:
      self._buffer.forget(gid)
    self.retire(doomed)
    with self._cond:
      self.num_cancelled += len(doomed)
    return doomed

  @property
  def in_system(self) -> int:
    with self._cond:
      return len(self._in_system)

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()
