"""The open work a checkpoint saves, as typed records (`open_work.py` says
what each restart point means).

In memory the open work is these frozen dataclasses; on disk it is their JSON
in the checkpoint's run record (`WorkRecord.to_json`). `WorkRecord.from_json`
checks a saved record field by field, naming the first one it cannot read
(`work.groups[3].episodes[1].loss_mask: ...`), before anything is restored.

Versions: 1 is the untyped layout checkpoints held before the records were
typed (checkpoint format 3: the same keys, no `version`), read as it is; 2
adds the `version` field. A record newer than this code is refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

# The format this code writes.
WORK_VERSION = 2
STAGES = ("sample", "env", "done")


class WorkRecordError(ValueError):
  """A saved open-work record this code cannot read (the message names the field)."""


def _get(record: Mapping, key: str, kind, where: str, optional: bool = False):
  if not isinstance(record, Mapping):
    raise WorkRecordError(f"{where}: must be a JSON object, got {type(record).__name__}")
  if key not in record:
    if optional:
      return None
    raise WorkRecordError(f"{where}.{key}: missing")
  value = record[key]
  if optional and value is None:
    return None
  # (bool is an int in Python, and JSON has no int float distinction for 1.0)
  ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
  if kind is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not ok:
    raise WorkRecordError(f"{where}.{key}: must be {getattr(kind, '__name__', kind)}, got "
                          f"{value!r}")
  return value


def _numbers(record: Mapping, key: str, kind, where: str) -> tuple:
  values = _get(record, key, list, where)
  try:
    return tuple(kind(v) for v in values)
  except (TypeError, ValueError) as e:
    raise WorkRecordError(f"{where}.{key}: not a list of {kind.__name__}s: {e}") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpenSegment:
  """What a sampler slot had sampled of an episode's current segment."""

  tokens: tuple[int, ...]
  logprobs: tuple[float, ...]
  versions: tuple[int, ...]

  def __post_init__(self):
    if not len(self.tokens) == len(self.logprobs) == len(self.versions):
      raise WorkRecordError(f"an open segment has {len(self.tokens)} tokens, "
                            f"{len(self.logprobs)} log-probs and {len(self.versions)} versions")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeRecord:
  """One rollout of a group at its restart point.

  Attributes:
    stage: `sample`, `env` or `done` (`open_work.py`).
    completion_ids, loss_mask, logprobs, versions: the completion so far (for
      `done`: the rollout's), one entry a token.
    turns: environment turns taken (`sample`, `env`).
    last_stopped: the last segment ended on a stop token (`sample`, `env`).
    open: the open segment of an episode in a sampler slot (`sample`).
    finish_reason, reward, env_name, reward_parts, outcome: the scored
      rollout's (`done`).
    prompt_ids: a `done` rollout's own prompt, when it is not its group's
      (an agent's session renders its own: `gateway/agent_runner.py`);
      None: the group's.
    held_by: the process holding a `done` rollout's arrays in a
      multi-controller run, before the save gathers them (then the per-token
      fields are empty and `completion_length` says how many there are).
  """

  stage: str
  completion_ids: tuple[int, ...] = ()
  loss_mask: tuple[float, ...] = ()
  logprobs: tuple[float, ...] = ()
  versions: tuple[int, ...] = ()
  turns: int = 0
  last_stopped: bool = False
  open: OpenSegment | None = None
  finish_reason: str | None = None
  reward: float | None = None
  env_name: str | None = None
  reward_parts: Mapping[str, float] = dataclasses.field(default_factory=dict)
  outcome: str = ""
  held_by: int | None = None
  completion_length: int | None = None
  prompt_ids: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.stage not in STAGES:
      raise WorkRecordError(f"unknown restart point {self.stage!r}; known: {STAGES}")
    lengths = {len(self.completion_ids), len(self.loss_mask), len(self.logprobs),
               len(self.versions)}
    if len(lengths) != 1:
      raise WorkRecordError(f"completion_ids, loss_mask, logprobs and versions differ in "
                            f"length: {sorted(lengths)}")

  @property
  def completion_tokens(self) -> int:
    """Tokens of the completion, held elsewhere or not (the open segment aside)."""
    return self.completion_length if self.held_by is not None else len(self.completion_ids)

  def to_json(self) -> dict:
    if self.held_by is not None:
      return {"stage": self.stage, "held_by": self.held_by,
              "completion_length": self.completion_length,
              "finish_reason": self.finish_reason, "reward": self.reward,
              "env_name": self.env_name, **self._score_json()}
    record = {"stage": self.stage, "completion_ids": list(self.completion_ids),
              "loss_mask": list(self.loss_mask), "logprobs": list(self.logprobs),
              "versions": list(self.versions)}
    if self.stage == "done":
      record.update(finish_reason=self.finish_reason, reward=self.reward,
                    env_name=self.env_name, **self._score_json())
      if self.prompt_ids is not None:
        record["prompt_ids"] = list(self.prompt_ids)
    else:
      record.update(turns=self.turns, last_stopped=self.last_stopped)
      if self.open is not None:
        record["open"] = {"tokens": list(self.open.tokens), "logprobs": list(self.open.logprobs),
                          "versions": list(self.open.versions)}
    return record

  def _score_json(self) -> dict:
    # (only when there is something: records written before these fields
    # existed read the same)
    record = {}
    if self.reward_parts:
      record["reward_parts"] = dict(self.reward_parts)
    if self.outcome:
      record["outcome"] = self.outcome
    return record

  @classmethod
  def from_json(cls, record: Mapping, where: str) -> EpisodeRecord:
    stage = _get(record, "stage", str, where)
    if stage not in STAGES:
      raise WorkRecordError(f"{where}.stage: unknown restart point {stage!r}; known: {STAGES}")
    done = {}
    if stage == "done":
      reward = _get(record, "reward", float, where, optional=True)
      done = dict(finish_reason=_get(record, "finish_reason", str, where),
                  reward=None if reward is None else float(reward),
                  env_name=_get(record, "env_name", str, where),
                  outcome=_get(record, "outcome", str, where, optional=True) or "")
      parts = _get(record, "reward_parts", Mapping, where, optional=True) or {}
      for name in parts:
        _get(parts, name, float, f"{where}.reward_parts")
      done["reward_parts"] = {str(k): float(v) for k, v in parts.items()}
    if "held_by" in record:
      if stage != "done":
        raise WorkRecordError(f"{where}.held_by: only a scored rollout is held elsewhere")
      return cls(stage=stage, held_by=_get(record, "held_by", int, where),
                 completion_length=_get(record, "completion_length", int, where), **done)
    arrays = dict(completion_ids=_numbers(record, "completion_ids", int, where),
                  loss_mask=_numbers(record, "loss_mask", float, where),
                  logprobs=_numbers(record, "logprobs", float, where),
                  versions=_numbers(record, "versions", int, where))
    try:
      if stage == "done":
        prompt = (_numbers(record, "prompt_ids", int, where) if "prompt_ids" in record
                  else None)
        return cls(stage=stage, **arrays, **done, prompt_ids=prompt)
      segment = _get(record, "open", Mapping, where, optional=True)
      opened = None if segment is None else OpenSegment(
          tokens=_numbers(segment, "tokens", int, f"{where}.open"),
          logprobs=_numbers(segment, "logprobs", float, f"{where}.open"),
          versions=_numbers(segment, "versions", int, f"{where}.open"))
      return cls(stage=stage, **arrays, turns=_get(record, "turns", int, where),
                 last_stopped=_get(record, "last_stopped", bool, where), open=opened)
    except WorkRecordError as e:
      if str(e).startswith(where):
        raise
      raise WorkRecordError(f"{where}: {e}") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupRecord:
  """One open group: its request's identity and its G episodes.

  Attributes:
    group_id: the group's id (kept across the restart).
    prompt: the prompt record as JSON (`envs/prompt_codec.py`).
    prompt_ids: the prompt's token ids.
    attempt: dropped groups of this prompt dispatched before it.
    dispatch_version: the live version when it was dispatched.
    arrival_version: the version it entered the buffer at (None: not yet).
    episodes: its rollouts at their restart points, in sample order.
  """

  group_id: int
  prompt: object
  prompt_ids: tuple[int, ...]
  attempt: int
  dispatch_version: int
  arrival_version: int | None
  episodes: tuple[EpisodeRecord, ...]

  def to_json(self) -> dict:
    return {"group_id": self.group_id, "prompt": self.prompt,
            "prompt_ids": list(self.prompt_ids), "attempt": self.attempt,
            "dispatch_version": self.dispatch_version, "arrival_version": self.arrival_version,
            "episodes": [e.to_json() for e in self.episodes]}

  @classmethod
  def from_json(cls, record: Mapping, where: str) -> GroupRecord:
    episodes = _get(record, "episodes", list, where)
    return cls(group_id=_get(record, "group_id", int, where),
               prompt=_get(record, "prompt", object, where),
               prompt_ids=_numbers(record, "prompt_ids", int, where),
               attempt=_get(record, "attempt", int, where),
               dispatch_version=_get(record, "dispatch_version", int, where),
               arrival_version=_get(record, "arrival_version", int, where, optional=True),
               episodes=tuple(EpisodeRecord.from_json(e, f"{where}.episodes[{i}]")
                              for i, e in enumerate(episodes)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkCounters:
  """The dispatcher's counters: groups started, cancelled in flight, prompts
  requeued, groups reassigned to another sampler."""

  started: int
  cancelled: int
  requeued: int
  reassigned: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkRecord:
  """All the open work of a run at a checkpoint.

  Attributes:
    version: this record's format (`WORK_VERSION`; 1: saved before records
      were typed).
    prompts_drawn: prompts taken from the stream (requeued ones not again).
    stream_state: the grain iterator's position (None: a plain iterator).
    groups: every open group, in group-id order.
    requeued: `(prompt as JSON, attempt)` of dropped prompts to dispatch again.
    next_group_id: the id the next group gets.
    counters: the dispatcher's counters.
  """

  version: int = WORK_VERSION
  prompts_drawn: int
  stream_state: object
  groups: tuple[GroupRecord, ...]
  requeued: tuple[tuple[object, int], ...]
  next_group_id: int
  counters: WorkCounters

  def to_json(self) -> dict:
    c = self.counters
    return {"version": self.version, "prompts_drawn": self.prompts_drawn,
            "stream_state": self.stream_state, "groups": [g.to_json() for g in self.groups],
            "requeued": [[prompt, attempt] for prompt, attempt in self.requeued],
            "next_group_id": self.next_group_id,
            "counters": {"started": c.started, "cancelled": c.cancelled,
                         "requeued": c.requeued, "reassigned": c.reassigned}}

  @classmethod
  def from_json(cls, record: Mapping, where: str = "work") -> WorkRecord:
    """The record of `record` (a format-1 or format-2 layout).

    Raises:
      WorkRecordError: naming the first field it cannot read.
    """
    version = _get(record, "version", int, where, optional=True) or 1
    if version > WORK_VERSION:
      raise WorkRecordError(f"{where}.version: {version} is newer than this code reads "
                            f"({WORK_VERSION}); resume it with a newer arl_jax")
    if "stream_state" not in record:
      raise WorkRecordError(f"{where}.stream_state: missing")
    requeued = []
    for i, item in enumerate(_get(record, "requeued", list, where)):
      if not (isinstance(item, list) and len(item) == 2 and type(item[1]) is int):
        raise WorkRecordError(f"{where}.requeued[{i}]: must be [prompt, attempt], got {item!r}")
      requeued.append((item[0], item[1]))
    counters = _get(record, "counters", Mapping, where)
    return cls(
        version=WORK_VERSION, prompts_drawn=_get(record, "prompts_drawn", int, where),
        stream_state=record["stream_state"],
        groups=tuple(GroupRecord.from_json(g, f"{where}.groups[{i}]")
                     for i, g in enumerate(_get(record, "groups", list, where))),
        requeued=tuple(requeued), next_group_id=_get(record, "next_group_id", int, where),
        counters=WorkCounters(
            started=_get(counters, "started", int, f"{where}.counters"),
            cancelled=_get(counters, "cancelled", int, f"{where}.counters"),
            requeued=_get(counters, "requeued", int, f"{where}.counters"),
            reassigned=_get(counters, "reassigned", int, f"{where}.counters",
                            optional=True) or 0))

  def describe(self) -> str:
    """One line for the resume message."""
    stages = {s: 0 for s in STAGES}
    for g in self.groups:
      for e in g.episodes:
        stages[e.stage] += 1
    return (f"{self.prompts_drawn} prompts drawn; {len(self.groups)} open groups go on "
            f"(rollouts: {stages['done']} scored, {stages['env']} at their environment, "
            f"{stages['sample']} at the sampler, {self.open_tokens} tokens of open segments "
            f"kept); {len(self.requeued)} requeued prompts")

  @property
  def open_tokens(self) -> int:
    return sum(len(e.open.tokens) for g in self.groups for e in g.episodes if e.open is not None)

  @property
  def tokens(self) -> int:
    """Sampled tokens the record keeps (completions and open segments)."""
    return sum(e.completion_tokens for g in self.groups for e in g.episodes) + self.open_tokens
