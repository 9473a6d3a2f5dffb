"""`Keeper`: the learner side's decisions in a run's schedule, written or followed.

The orchestrator's decisions that depend on timing are the groups each cut
sweeps and takes (which groups have finished by then), the groups each
publish cancels (which are still generating then) and the version a
finished group arrives at (`core/schedule.py`). Recording, the keeper writes
them as they are made; replaying a segment of a recorded run, it hands the
orchestrator the recorded ones (a cut waits until its groups have arrived)
and checks what the learner loop does (updates, evaluations, saves) against
the recording, naming the first update whose inputs or params differ.

The learner's events form one ordered stream (cuts, publishes, saves); the
end of a segment, or the stop sequence's save, stops the replay there
(`schedule.ReplayStop`).
"""

from __future__ import annotations

import collections

from arl_jax.core import schedule as schedule_lib


class Keeper:
  """Records to `log`, or follows `segment` (exactly one of them)."""

  def __init__(self, *, log: schedule_lib.Log | None = None,
               segment: schedule_lib.Segment | None = None):
    if (log is None) == (segment is None):
      raise ValueError("a schedule keeper records (log) or replays (segment), one of them")
    self._log = log
    self._stream = collections.deque()
    self._arrivals: dict[int, int] = {}
    self._checks: dict[tuple[str, int], dict] = {}  # (kind, version) -> update / eval event
    if segment is not None:
      self._arrivals = dict(segment.arrivals)
      for event in segment.learner:
        if event["e"] in ("update", "eval"):
          self._checks[(event["e"], int(event["v"]))] = event
        else:
          self._stream.append(event)

  @property
  def replaying(self) -> bool:
    return self._log is None

  def flush(self) -> int | None:
    """Recording: writes the schedule's buffered lines out and returns its
    line count (a checkpoint keeps it); replaying: None."""
    return None if self._log is None else self._log.flush()

  def write(self, event: str, **fields) -> None:
    if self._log is not None:
      self._log.write(event, **fields)

  # -- orchestrator -----------------------------------------------------------

  def arrival_version(self, group_id: int, version: int) -> int:
    """The version a finished group arrives at: `version`, or in a replay
    the recorded one (a group the recorded run did not keep arrives at
    `version`; the recorded cancellation removes it)."""
    return version if self._log is not None else self._arrivals.get(group_id, version)

  def arrived(self, group_id: int, version: int) -> None:
    """Record: a finished group was kept, stamped `version`."""
    self.write("arrive", g=group_id, v=version)

  def cut_due(self, batch_version: int) -> dict:
    """Replay: the recorded cut attempt of `B_{batch_version}` due now.

    Raises:
      schedule.ReplayStop: the recorded run made no more cuts here.
      schedule.ReplayDiverged: it did something else first.
    """
    return self._next("cut", batch_version, "u")

  def cut(self, batch_version: int, stale, groups) -> None:
    """Record: a cut attempt that swept or took something."""
    if self._log is not None and (stale or groups is not None):
      self._log.write("cut", u=batch_version, stale=[g.group_id for g in stale],
                      g=None if groups is None else [g.group_id for g in groups])

  def consume(self) -> None:
    self._stream.popleft()

  def cancellations_due(self, version: int) -> list[int] | None:
    """Replay: the groups the recorded publish of `version` cancelled (None:
    not replaying)."""
    if self._log is not None:
      return None
    event = self._next("publish", version, "v")
    self._stream.popleft()
    return [int(g) for g in event["cancel"]]

  def published(self, version: int, cancelled) -> None:
    self.write("publish", v=version, cancel=sorted(cancelled))

  def _next(self, kind: str, value: int, key: str) -> dict:
    if not self._stream:
      raise schedule_lib.ReplayStop(schedule_lib.REPLAY_STOP)
    event = self._stream[0]
    if event["e"] == "save" and event.get("final"):
      raise schedule_lib.ReplayStop(schedule_lib.REPLAY_STOP)
    if event["e"] != kind or int(event[key]) != value:
      raise schedule_lib.ReplayDiverged(
          "the learner's next decision", f"{event['e']} {event.get(key, event.get('v'))}",
          f"{kind} {value}")
    return event

  # -- learner loop -----------------------------------------------------------

  def updated(self, step: int, version: int, *, tokens: str, versions: str, params: str) -> None:
    """Update `step` trained a batch (hashes of its tokens and their versions)
    into `params` (their fingerprint): written, or checked in the order an
    update's inputs come (the batch's versions, its tokens, then the params)."""
    if self._log is not None:
      self._log.write("update", u=step, v=version, tok=tokens, ver=versions, par=params)
      return
    recorded = self._checks.get(("update", version))
    if recorded is None:
      raise schedule_lib.ReplayDiverged("whether it ran", "not recorded", "ran", step)
    for key, what, value in (("ver", "the batch's token versions", versions),
                             ("tok", "the batch's tokens", tokens),
                             ("par", "the params hash after it", params)):
      if recorded[key] != value:
        raise schedule_lib.ReplayDiverged(what, recorded[key], value, step)

  def evaluated(self, version: int) -> None:
    if self._log is not None:
      self._log.write("eval", v=version)
    elif ("eval", version) not in self._checks:
      raise schedule_lib.ReplayDiverged(f"an evaluation at version {version}", "none", "one")

  def saved(self, version: int, final: bool) -> None:
    """A checkpoint of `version` is being saved (the stop sequence's: `final`)."""
    if self._log is not None:
      self._log.write("save", v=version, **({"final": True} if final else {}))
      return
    event = self._stream[0] if self._stream else None
    if event is None or event["e"] != "save" or int(event["v"]) != version:
      recorded = "nothing" if event is None else f"{event['e']} {event.get('v', event.get('u'))}"
      raise schedule_lib.ReplayDiverged("the learner's next decision", recorded,
                                        f"save {version}")
    self._stream.popleft()
