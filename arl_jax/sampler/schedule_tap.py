"""`EngineTap`: the sampler engine's decisions, written down or followed.

An engine iteration is a function of what it starts with and four inputs
the clock decides (`core/schedule.py`): the cancellations applied at its top,
the version offered to the weight-update policy, the groups `take` hands it,
and whether the learner held it before it (a checkpoint's instant). The tap
numbers the iterations (`n`, those that ran `Scheduler.iterate`) and either
writes each input with its `n` (recording) or, replaying a segment of a
recorded run, hands the engine exactly the recorded input at each `n`,
waiting for the learner where the recorded run had it already (a version
published, a cancellation asked for, a prompt requeued).

Replay holds cancellations asked for until their recorded iteration, so
the engine's own reads of its pending cancellations (decode bursts) see
what they saw.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from arl_jax.core import schedule as schedule_lib

# How long a replay waits for an input the recorded run had by then.
WAIT_S = 120.0


class EngineTap:
  """Records the engine's inputs (`log`), or follows a recorded `segment`."""

  def __init__(self, *, log: schedule_lib.Log | None = None,
               segment: schedule_lib.Segment | None = None,
               params_fn: Callable[[int, float], object] | None = None):
    """Args:
      log: where a recording run writes (None: replaying).
      segment: the recorded segment a replay follows (None: recording).
      params_fn: `(version, timeout) -> params or None`: a published
        version's params, waiting up to `timeout` (replay).
    """
    if (log is None) == (segment is None):
      raise ValueError("an engine tap records (log) or replays (segment), one of them")
    self.n = 0  # engine iterations run so far
    self._log = log
    self._params_fn = params_fn
    self._stopped_fn = lambda: False  # (the engine's, `attach`)
    self._cond = threading.Condition()
    self._requested: set[int] = set()  # replay: cancellations asked for, not yet due
    self._last_offer: tuple[int, str] | None = None  # record: the last written
    self._deferred: int | None = None  # replay: a version the policy defers, offered again
    self._due: dict[int, dict[str, collections.deque]] = {}
    if segment is not None:
      for n, events in segment.engine.items():
        kinds = self._due.setdefault(n, collections.defaultdict(collections.deque))
        for event in events:
          kinds[event["e"]].append(event)

  def attach(self, stopped_fn: Callable[[], bool]) -> None:
    """The engine's: whether it is stopping (a replay's waits end then)."""
    self._stopped_fn = stopped_fn

  @property
  def replaying(self) -> bool:
    return self._log is None

  def wrap(self, requests):
    """`requests` (a `RequestSource`) as the engine takes from it through the tap."""
    return _TappedRequests(requests, self)

  def _pop(self, kind: str) -> dict | None:
    kinds = self._due.get(self.n)
    return kinds[kind].popleft() if kinds is not None and kinds[kind] else None

  def wait(self, fn: Callable[[float], object], what: str):
    """Calls `fn(timeout)` until it returns something other than None (a
    replay waiting for the learner or the env workers).

    Raises:
      schedule.ReplayStop: the engine is stopping.
      schedule.ReplayDiverged: nothing came in `WAIT_S`.
    """
    deadline = time.monotonic() + WAIT_S
    while True:
      result = fn(0.05)
      if result is not None:
        return result
      if self._stopped_fn():
        raise schedule_lib.ReplayStop("the engine stopped")
      if time.monotonic() > deadline:
        raise schedule_lib.ReplayDiverged(
            f"engine iteration {self.n}: {what}", "there", f"not within {WAIT_S:.0f} s")

  # -- cancellations ------------------------------------------------------------

  def request_cancel(self, group_ids) -> None:
    """A replay's cancellation, held until its recorded iteration (thread-safe)."""
    with self._cond:
      self._requested.update(group_ids)
      self._cond.notify_all()

  def cancels_due(self) -> list[list[int]]:
    """Replay: the cancellations the recorded run applied at this iteration,
    each once it was asked for."""
    due = []
    while (event := self._pop("cancel")) is not None:
      ids = set(event["g"])

      def asked(timeout, ids=ids):
        with self._cond:
          if not self._cond.wait_for(lambda: ids <= self._requested, timeout):
            return None
          self._requested -= ids
          return sorted(ids)

      due.append(self.wait(asked, f"the cancellation of groups {sorted(ids)}"))
    return due

  def cancelled(self, group_ids) -> None:
    """Record: the engine applied these cancellations at this iteration."""
    if group_ids:
      self._log.write("cancel", n=self.n, g=sorted(group_ids))

  # -- versions -----------------------------------------------------------------

  def offer_due(self, live: int | None) -> tuple[int, str] | None:
    """Replay: the version to offer the weight-update policy at this
    iteration and its recorded answer; None: nothing offered."""
    event = self._pop("offer")
    if event is None:
      return None if self._deferred is None else (self._deferred, "defer")
    version = int(event["v"])
    if live is not None and version <= live:
      raise schedule_lib.ReplayDiverged(f"engine iteration {self.n}: the offered version",
                                        version, f"live {live}")
    return version, event["s"]

  def params(self, version: int):
    """Replay: the params of `version`, once published."""
    return self.wait(lambda timeout: self._params_fn(version, timeout),
                     f"the publish of version {version}")

  def offered(self, version: int, answer: str, expected: str | None = None) -> None:
    """The policy answered `answer` to `version`: recorded when it differs
    from the last answer written (a drain defers the same version at every
    iteration), or checked against the recording."""
    if self.replaying:
      if answer != expected:
        raise schedule_lib.ReplayDiverged(
            f"engine iteration {self.n}: the policy's answer to version {version}",
            expected, answer)
      self._deferred = version if answer == "defer" else None
    elif (version, answer) != self._last_offer:
      self._log.write("offer", n=self.n, v=version, s=answer)
      self._last_offer = (version, answer)

  # -- pauses ---------------------------------------------------------------------

  def serve(self, gate) -> None:
    """Between two iterations: records a hold the learner asked for, or
    (replay) serves one exactly where the recorded run did, waiting for it."""
    if not self.replaying:  # (written before the learner goes on: ahead of its save)
      gate.serve(lambda: self._log.write("pause", n=self.n))
      return
    while self._pop("pause") is not None:
      self.wait(lambda timeout: True if gate.requested else time.sleep(0.005),
                "the learner's hold")
      gate.serve()


class _TappedRequests:
  """The engine's `RequestSource`, through the tap."""

  def __init__(self, requests, tap: EngineTap):
    self._requests = requests
    self._tap = tap

  def take(self, max_groups: int, live_version: int, timeout: float) -> list:
    tap = self._tap
    if not tap.replaying:
      requests = self._requests.take(max_groups, live_version, timeout)
      if requests:
        tap._log.write("take", n=tap.n, g=[r.group_id for r in requests],
                       a=[r.attempt for r in requests])
      return requests
    event = tap._pop("take")
    if event is None:
      return []
    if len(event["g"]) > max_groups:
      raise schedule_lib.ReplayDiverged(f"engine iteration {tap.n}: groups with room",
                                        len(event["g"]), max_groups)
    return tap.wait(lambda t: self._requests.take_recorded(event["g"], event["a"], live_version,
                                                           timeout=t),
                    f"the start of groups {event['g']}")

  def note_sampling(self, group_id: int, version: int) -> None:
    self._requests.note_sampling(group_id, version)
