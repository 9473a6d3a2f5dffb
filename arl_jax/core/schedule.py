"""A run's schedule: every decision of an asynchronous run that timing made.

Tokens depend only on counter-based keys (seed, group, sample, turn, offset)
and on the params in force at each decode step, and an update only on its
batch; what the clock decides is which group starts when, under which
version, where each weight swap falls between decode steps, which finished
groups each batch cut takes, and which groups are cancelled. A run with
`replay.record` writes those decisions to `<workdir>/schedule.jsonl`, one
JSON object a line, from the threads that make them (`Log`); a replay
(`replay.from_run`) reads them back (`Schedule`) and its sampler engine and
orchestrator follow them instead of the clock (`sampler/schedule_tap.py`,
`orchestrator/schedule_follow.py`).

Events (`e`), by the stream that follows them:

- engine (indexed by `n`, the engine iterations run so far): `take` (group
  ids `g` and their requeue attempts `a`), `cancel` (group ids applied),
  `offer` (version `v` offered to the weight-update policy, its answer `s`),
  `pause` (a learner's hold served before iteration `n`);
- learner, in order: `cut` (batch version `u`, the `stale` ids swept, the
  batch's ids `g` or null), `publish` (version `v`, the ids it cancelled),
  `update` (its step `u`, version `v` and hashes of the batch's tokens
  `tok`, its token versions `ver` and the params after it `par`), `eval`,
  `save` (`final` for the stop sequence's);
- `arrive`: the version a finished group was stamped with;
- `segment`: a run (fresh or resumed) starts at version `v`.

The file is one of the record files a checkpoint keeps the line count of
(`training/records.py`), so a resumed run's schedule continues exactly from
its checkpoint; a replay of it resumes at the same versions.

Plain Python: no JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import threading

from arl_jax.core import settings

FILE = "schedule.jsonl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig:
  """The `replay` config section.

  Attributes:
    record: write the run's schedule (`schedule.jsonl` in the workdir) so
      that `--replay` can run it again to the same params.
    from_run: a recorded run's workdir: follow its schedule instead of the
      clock ("": no replay). The config must be the recorded run's.
  """

  record: bool = False
  from_run: str = ""

  def __post_init__(self):
    settings.check(isinstance(self.record, bool), "record", f"must be a bool, got {self.record!r}")
    settings.check(isinstance(self.from_run, str), "from_run",
                   f"must be a folder path, got {self.from_run!r}")
    settings.check(not (self.record and self.from_run), "record",
                   "a replay (from_run) follows a schedule; it does not record one")

  def check_runnable(self, multi_turn: bool, fleet, agent) -> None:
    """Raises ValueError (naming the key) for what a schedule does not hold
    yet: multi-turn episodes, a `fleet` of remote samplers, an `agent`."""
    if not (self.record or self.from_run):
      return
    key = "replay.record" if self.record else "replay.from_run"
    if multi_turn:
      raise ValueError(f"{key}: multi-turn episodes (when each comes back from its "
                       "environment) are not part of the schedule yet")
    if fleet.remote or agent.enabled:
      raise ValueError(f"{key}: only a run whose sampler is this process's engine (no "
                       "fleet.remote, no agent)")
    if self.from_run and not os.path.isfile(os.path.join(self.from_run, FILE)):
      raise ValueError(f"{key}: no {FILE} in {self.from_run!r} (record one with "
                       "replay.record=True)")


class ScheduleError(ValueError):
  """A schedule file that cannot be read (missing, malformed)."""


class ReplayDiverged(RuntimeError):
  """The replay differs from the recorded run: `step` (an update, or None
  when not known), `what` (the input that differs) and both values."""

  def __init__(self, what: str, recorded, replayed, step: int | None = None):
    where = "" if step is None else f"update {step}: "
    super().__init__(f"replay diverged: {where}{what} differs (recorded {recorded!r}, "
                     f"replayed {replayed!r})")
    self.step, self.what, self.recorded, self.replayed = step, what, recorded, replayed


class ReplayStop(Exception):
  """The recorded run stopped here (its stop sequence, or the end of a
  segment a resume continued): the replay stops too. `reason` says which."""


REPLAY_STOP = "replay: the recorded run stopped here"


class Log:
  """Appends events to the schedule file (thread-safe). `lines` counts the
  file's lines, those already there included (a checkpoint records it)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, FILE)
    self.lines = 0
    if os.path.exists(self.path):
      with open(self.path, "rb") as f:
        self.lines = sum(1 for _ in f)
    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
    self._lock = threading.Lock()

  def write(self, event: str, **fields) -> None:
    line = json.dumps({"e": event, **fields}, separators=(",", ":")) + "\n"
    with self._lock:
      if self._file.closed:  # (a thread that outlives the run)
        return
      # Buffered: a flush a line (a system call: the GIL given up, then
      # waited for behind the sampler's thread) took 133 us an event inside
      # a recorded arith run, 5 us alone (benchmarks/replay.py). A
      # checkpoint flushes the lines it counts (`flush`); a kill loses only
      # lines after it, which a resume drops anyway; a stop's `close`
      # writes them all.
      self._file.write(line)
      self.lines += 1

  def flush(self) -> int:
    """Writes the buffered lines to the file; returns how many lines it has
    (what a checkpoint records: every one of them in the file)."""
    with self._lock:
      if not self._file.closed:
        self._file.flush()
      return self.lines

  def close(self) -> None:
    with self._lock:
      self._file.close()


@dataclasses.dataclass
class Segment:
  """The events of one run (a fresh start, or a resume) of a recorded run.

  Attributes:
    version: the version it started at.
    engine: iteration -> the engine's events there, in order.
    learner: the learner thread's events, in order.
    arrivals: group id -> the version its arrival was stamped with.
  """

  version: int
  engine: dict[int, list[dict]] = dataclasses.field(
      default_factory=lambda: collections.defaultdict(list))
  learner: list[dict] = dataclasses.field(default_factory=list)
  arrivals: dict[int, int] = dataclasses.field(default_factory=dict)


_ENGINE = ("take", "cancel", "offer", "pause")
_LEARNER = ("cut", "publish", "update", "eval", "save")


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_ints(value) -> bool:
  return isinstance(value, list) and all(_is_int(v) for v in value)


# Each event's fields and what each must hold (a file a user points at: a
# wrong type is named with its line, not left to fail deep in a replay).
_INT = ("a whole number", _is_int)
_INTS = ("a list of whole numbers", _is_ints)
_TEXT = ("a string", lambda value: isinstance(value, str))
_FIELDS = {
    "take": {"n": _INT, "g": _INTS, "a": _INTS},
    "cancel": {"n": _INT, "g": _INTS},
    "offer": {"n": _INT, "v": _INT, "s": _TEXT},
    "pause": {"n": _INT},
    "cut": {"u": _INT, "stale": _INTS,
            "g": ("a list of whole numbers or null", lambda v: v is None or _is_ints(v))},
    "publish": {"v": _INT, "cancel": _INTS},
    "update": {"u": _INT, "v": _INT, "tok": _TEXT, "ver": _TEXT, "par": _TEXT},
    "eval": {"v": _INT},
    "save": {"v": _INT},
    "arrive": {"g": _INT, "v": _INT},
    "segment": {"v": _INT},
}


def _field_error(event: dict) -> str | None:
  """What is wrong with an event's fields (None: nothing)."""
  for key, (what, holds) in _FIELDS[event["e"]].items():
    if key not in event:
      return f"a {event['e']} event lacks its {key!r} field"
    if not holds(event[key]):
      return f"a {event['e']} event's {key!r} must be {what}, got {event[key]!r:.40}"
  return None


def complete_lines(path: str) -> list[bytes]:
  """The lines of the JSON-lines file at `path` (each with its newline), but
  a torn last one: a writer killed mid-line leaves one without its newline
  (`training/records.py` moves it aside when the run resumes)."""
  with open(path, "rb") as f:
    lines = f.read().splitlines(keepends=True)
  return lines if not lines or lines[-1].endswith(b"\n") else lines[:-1]


def read_events(run_dir: str) -> list[dict]:
  """The events of `run_dir`'s schedule, checked line by line. A torn last
  line (a killed run's) is left out.

  Raises:
    ScheduleError: no schedule there, or a line that is not an event.
  """
  path = run_dir if run_dir.endswith(FILE) else os.path.join(run_dir, FILE)
  if not os.path.isfile(path):
    raise ScheduleError(f"no schedule at {path} (record one with replay.record=True)")
  events = []
  for number, line in enumerate(complete_lines(path), 1):
    try:
      event = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ScheduleError(f"{path}:{number}: not JSON ({e.msg if hasattr(e, 'msg') else e})"
                          ) from None
    kind = event.get("e") if isinstance(event, dict) else None
    if kind not in _FIELDS:
      raise ScheduleError(f"{path}:{number}: not a schedule event: {line[:80]!r}")
    problem = _field_error(event)
    if problem:
      raise ScheduleError(f"{path}:{number}: {problem}")
    events.append(event)
  if not events:
    raise ScheduleError(f"{path} is empty")
  if events[0]["e"] != "segment":
    raise ScheduleError(f"{path}:1: a schedule starts with a segment event")
  return events


def load(run_dir: str) -> list[Segment]:
  """`run_dir`'s schedule as its segments (one per start or resume)."""
  segments = []
  for event in read_events(run_dir):
    kind = event["e"]
    if kind == "segment":
      segments.append(Segment(version=int(event["v"])))
    elif kind in _ENGINE:
      segments[-1].engine[int(event["n"])].append(event)
    elif kind in _LEARNER:
      segments[-1].learner.append(event)
    else:  # arrive
      segments[-1].arrivals[int(event["g"])] = int(event["v"])
  return segments


def segment_at(segments: list[Segment], version: int, run_dir: str) -> tuple[Segment, int | None]:
  """The segment a replay starting at `version` follows, and the version the
  next one starts at (where this one stops; None: the last)."""
  for i, segment in enumerate(segments):
    if segment.version == version:
      following = segments[i + 1].version if i + 1 < len(segments) else None
      return segment, following
  raise ScheduleError(f"{run_dir}: the recorded run never started at version {version} "
                      f"(its segments start at {[s.version for s in segments]})")


def digest(*parts) -> str:
  """A short hex digest of byte strings."""
  h = hashlib.blake2b(digest_size=8)
  for part in parts:
    h.update(part)
  return h.hexdigest()
