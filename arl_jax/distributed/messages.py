"""The messages between a learner and its sampler processes, one frozen
dataclass each.

A message class is registered under the `type` string it carries on the
wire (`KINDS`). `to_wire(message)` is the dict `wire.encode` sends;
`from_frames(frames, allowed)` decodes one (`wire.decode`) and rebuilds the
message, checking every field against its annotation (an int is an int, not
a bool; a float may arrive as an int; a list's items and a dict's values
where the annotation names them) and the message's own `check`, and raises
ValueError naming the message and the field. Handlers then dispatch on the
class (`match`) and read typed fields: nothing a peer sends reaches them
unchecked, and a new message is a dataclass here, not a string compared in
three places.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

from arl_jax.distributed import wire

KINDS: dict[str, type] = {}


def _message(kind: str):
  def register(cls):
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    cls.kind = kind
    KINDS[kind] = cls
    return cls
  return register


class Message:
  """A message's base: `kind` (its wire `type`), and `check`, called after
  every field conforms to its annotation."""

  kind = ""

  def check(self) -> None:
    """Raises ValueError when the fields, each of the right type, disagree."""


Notes = list[list[int]]  # [group id, version] pairs: groups whose sampling started


def _check_notes(notes) -> None:
  if not all(len(n) == 2 for n in notes):
    raise ValueError("notes must be [group id, version] pairs")


def _as_lists(message) -> None:
  """Notes as lists of lists, however given (as they arrive)."""
  object.__setattr__(message, "notes", [list(n) for n in message.notes])


# -- sampler -> learner ------------------------------------------------------------------


@_message("hello")
class Hello(Message):
  """A sampler process asks to join: its name and device count (and its
  process index in a multi-controller run)."""

  name: str
  devices: int
  process: int | None = None


@_message("take")
class Take(Message):
  """Up to `n` groups for a sampler live at `version`."""

  n: int
  version: int
  notes: Notes = ()

  def __post_init__(self):
    _as_lists(self)

  def check(self) -> None:
    _check_notes(self.notes)


@_message("group")
class GroupDone(Message):
  """A finished group (`wire.group_to_wire`'s record; `wire.group_from_wire`
  checks the rest)."""

  group: dict

  def check(self) -> None:
    wire.check_fields(self.group, "group", {"group_id": int})


# A report's environment counters (`sampler_worker`'s `env`).
_ENV_KEYS = {"errors": dict, "timeouts": dict, "turns": int}


@_message("heartbeat")
class Heartbeat(Message):
  """A sampler is alive: its engine's stats and environment counters."""

  stats: dict
  env: dict
  notes: Notes = ()

  def __post_init__(self):
    _as_lists(self)

  def check(self) -> None:
    _check_notes(self.notes)
    wire.check_fields(self.env, "env", _ENV_KEYS)
    wire.stats_from_wire(self.stats)
    if not all(type(v) is int for key in ("errors", "timeouts")
               for v in self.env[key].values()):
      raise ValueError("environment counters that are not integers")


@_message("bye")
class Bye(Heartbeat):
  """A sampler leaves, with its last report."""


# -- learner -> sampler ------------------------------------------------------------------


@_message("welcome")
class Welcome(Message):
  """A sampler joined: its id, the run's resolved spec (`spec_codec`), its
  mesh, where to pull weights, and the heartbeat's timing."""

  sampler_id: int
  spec: dict
  sampler_mesh: list[list]
  weights_address: str
  heartbeat_s: float
  timeout_s: float


@_message("refused")
class Refused(Message):
  """A sampler may not join (its devices do not fit the run's mesh)."""

  reason: str


@_message("rejected")
class Rejected(Message):
  """A sampler was dropped (lost, unknown, or it broke the protocol)."""

  reason: str


@_message("groups")
class Groups(Message):
  """The answer to a `Take`: group requests (`wire.request_to_wire`)."""

  requests: list[dict]


@_message("cancel")
class Cancel(Message):
  """Drop these groups (too stale to ship, or the run no longer wants them)."""

  group_ids: list[int]


@_message("ack")
class Ack(Message):
  """The answer to a heartbeat: the learner is alive."""


@_message("lockstep")
class Lockstep(Message):
  """Multi-controller: process 0 reached lockstep `step`."""

  step: int


@_message("stop")
class Stop(Message):
  """The run ended: the sampler finishes what it sends and exits."""


FROM_SAMPLER = (Hello, Take, GroupDone, Heartbeat, Bye)
FROM_LEARNER = (Welcome, Refused, Rejected, Groups, Cancel, Ack, Lockstep, Stop)


def to_wire(message: Message) -> dict:
  """`message` as the dict `wire.encode` sends."""
  return {"type": message.kind,
          **{f.name: getattr(message, f.name) for f in dataclasses.fields(message)}}


def from_frames(frames: list, allowed: tuple[type, ...]) -> Message:
  """The message `frames` carry, checked.

  Raises:
    ValueError: naming what is wrong (the frames, an unknown or unexpected
      type, a missing or ill-typed field, a failed `check`).
  """
  return from_wire(wire.decode(frames), allowed)


def from_wire(record: dict, allowed: tuple[type, ...]) -> Message:
  """`from_frames` for a decoded dict."""
  kind = record.get("type")
  cls = KINDS.get(kind) if isinstance(kind, str) else None
  if cls is None or cls not in allowed:
    raise ValueError(f"unknown message type {kind!r}")
  hints = _hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(record) - set(fields) - {"type"})
  if unknown:
    raise ValueError(f"{kind!r} with unknown field(s) {unknown}")
  values = {}
  for name, field in fields.items():
    if name not in record:
      if field.default is dataclasses.MISSING:
        raise ValueError(f"{kind!r} without {name!r}")
      continue
    if not _conforms(record[name], hints[name]):
      raise ValueError(f"{kind}.{name} has the wrong type ({type(record[name]).__name__})")
    values[name] = record[name]
  message = cls(**values)
  try:
    message.check()
  except ValueError as e:
    raise ValueError(f"{kind}: {e}") from e
  return message


@functools.cache
def _hints(cls: type) -> dict:
  """`cls`'s resolved field annotations (resolved once per message class)."""
  return typing.get_type_hints(cls)


def _conforms(value, hint) -> bool:
  """Whether `value` (a decoded JSON value) is of the annotation `hint`."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    return any(_conforms(value, arg) for arg in args)
  if hint is type(None):
    return value is None
  if hint is int:
    return type(value) is int
  if hint is float:
    return type(value) in (int, float)
  if hint is str:
    return isinstance(value, str)
  if hint is dict or origin is dict:
    return isinstance(value, dict) and (not args or all(
        isinstance(k, str) and _conforms(v, args[1]) for k, v in value.items()))
  if hint is list or origin is list:
    return isinstance(value, (list, tuple)) and (not args or all(
        _conforms(v, args[0]) for v in value))
  raise TypeError(f"no wire check for {hint!r}")
