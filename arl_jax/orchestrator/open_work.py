"""Open work: every group started and not yet retired, at its latest restart point.

A checkpoint holds the sampled work in flight and in the buffer, not only the
learner state (docs/design.md section 6): the groups in flight are the long, hard
tasks, so regenerating them after a restart wastes the most expensive samples
and, when a run restarts often, biases training toward short tasks.

Each episode of a group is always at one of three restart points, recorded by
the thread that owns it at every handover:

- `sample`: waiting for a sampler slot or in one (fresh, or after an
  observation). The tokens an occupied slot has sampled so far (the open
  segment) are read from the sampler while it is held still
  (`SamplerEngine.paused`, `open_segments`) and added to the snapshot. A
  resume re-admits the episode with the open segment in its
  context, prefilled under the weights live then, and the segment goes on.
- `env`: its segment ended and the environment must answer or score it. A
  resume calls the environment again: environments are called with the prompt
  and the transcript only (`env_api.py`), so the transcript is the whole
  episode state and the recorded tokens are all there is to save.
- `done`: scored. The rollout waits for the rest of its group, or the whole
  group waits in the rollout buffer (with the version it arrived at, so it
  stays eligible under the same staleness rule).

Recording a point is O(1): it keeps the episode and its completion length,
and episodes only ever grow, so their first `length` entries are final; the
copy happens once, in `snapshot`.

Locks: the dispatcher calls in with its own lock held (dispatcher, then this
one); nothing here calls out.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from arl_jax.core import episode as episode_lib
from arl_jax.core import rollout as rollout_lib
from arl_jax.orchestrator import work_record

STAGES = work_record.STAGES


@dataclasses.dataclass
class _Point:
  """Where a resume picks an episode up (see the module docstring)."""

  stage: str
  episode: episode_lib.Episode | None = None  # None: not admitted yet (a fresh episode)
  length: int = 0  # completion tokens of `episode` that belong to this point
  turns: int = 0
  last_stopped: bool = False
  rollout: rollout_lib.Rollout | None = None  # stage `done`


@dataclasses.dataclass
class _Group:
  request: object  # group_request.GroupRequest
  points: list[_Point]
  arrival_version: int | None = None  # set once the group is in the buffer


@dataclasses.dataclass
class RestoredGroup:
  """One saved group, rebuilt: what goes back to which component.

  Attributes:
    group_id: the group's id (kept across the restart).
    to_sample: episodes for the sampler (fresh, between turns, or with an
      open segment).
    to_env: episodes whose environment call must be made (again).
    scored: finished rollouts of a group still generating.
    complete: the whole group, when all its rollouts were scored (it goes
      back into the buffer), else None.
    arrival_version: the version `complete` arrived at (None: not recorded).
    oldest_sampled: the oldest version among its sampled tokens (None: none).
  """

  group_id: int
  to_sample: list[episode_lib.Episode]
  to_env: list[episode_lib.Episode]
  scored: list[rollout_lib.Rollout]
  complete: rollout_lib.Group | None
  arrival_version: int | None
  oldest_sampled: int | None


class OpenWork:
  """Thread-safe registry of open groups and their episodes' restart points."""

  def __init__(self):
    self._lock = threading.Lock()
    self._groups: dict[int, _Group] = {}

  def __len__(self) -> int:
    with self._lock:
      return len(self._groups)

  def is_open(self, group_id: int) -> bool:
    with self._lock:
      return group_id in self._groups

  def open(self, request) -> None:
    """A group was dispatched: G fresh episodes."""
    with self._lock:
      self._groups[request.group_id] = _Group(
          request=request, points=[_Point("sample") for _ in range(request.group_size)])

  def restart(self, group_id: int) -> None:
    """The group starts again from scratch (its sampler was lost)."""
    with self._lock:
      group = self._groups.get(group_id)
      if group is not None:
        group.points = [_Point("sample") for _ in group.points]

  def at_sampler(self, episode: episode_lib.Episode) -> None:
    """`episode` goes (back) to the sampler, its completion as it is now."""
    self._mark(episode, "sample")

  def at_env(self, episode: episode_lib.Episode) -> None:
    """`episode`'s segment ended; it goes to its environment."""
    self._mark(episode, "env")

  def _mark(self, episode: episode_lib.Episode, stage: str) -> None:
    with self._lock:
      group = self._groups.get(episode.group_id)
      if group is not None:  # else retired (cancelled) meanwhile
        group.points[episode.sample_index] = _Point(
            stage, episode, len(episode.completion_ids), episode.turns, episode.last_stopped)

  def scored(self, rollout: rollout_lib.Rollout) -> None:
    with self._lock:
      group = self._groups.get(rollout.group_id)
      if group is not None:
        group.points[rollout.sample_index] = _Point("done", rollout=rollout)

  def arrived(self, group_id: int, version: int) -> None:
    """The group entered the rollout buffer at `version`."""
    with self._lock:
      group = self._groups.get(group_id)
      if group is not None:
        group.arrival_version = version

  def close(self, group_ids) -> None:
    """The groups were retired: trained, dropped or cancelled."""
    with self._lock:
      for gid in group_ids:
        self._groups.pop(gid, None)

  def snapshot(self, partials: dict, exclude=frozenset(),
               prompt_to_json=lambda p: p) -> list[work_record.GroupRecord]:
    """Every open group as a record, in group-id order.

    Args:
      partials: `{(group_id, sample_index): (tokens, logprobs, versions)}`, the
        open segment of each episode in a sampler slot (read by the caller on
        the sampler thread, which keeps those episodes still meanwhile).
      exclude: group ids to leave out (the batch being trained).
      prompt_to_json: prompt record -> JSON.
    """
    with self._lock:
      return [self._group_record(g, partials, prompt_to_json)
              for gid, g in sorted(self._groups.items()) if gid not in exclude]

  @staticmethod
  def _group_record(group: _Group, partials: dict, prompt_to_json) -> work_record.GroupRecord:
    request = group.request
    episodes = []
    for index, point in enumerate(group.points):
      if point.stage == "done":
        r = point.rollout
        scored = dict(stage="done", finish_reason=r.finish_reason, reward=r.reward,
                      env_name=r.env_name, reward_parts=dict(r.reward_parts),
                      outcome=r.outcome)
        if r.holder is not None:
          # Arrays in another process: `shard_batch.collect_held` fills them in
          # before the save.
          episodes.append(work_record.EpisodeRecord(
              held_by=r.holder, completion_length=r.completion_length, **scored))
        else:
          own_prompt = (None if np.array_equal(r.prompt_ids, request.prompt_ids)
                        else tuple(int(t) for t in r.prompt_ids))
          episodes.append(work_record.EpisodeRecord(**_arrays(
              r.completion_ids, r.loss_mask, r.behaviour_logprobs, r.token_versions), **scored,
              prompt_ids=own_prompt))
        continue
      e, n = point.episode, point.length
      arrays = _arrays(*(((), (), (), ()) if e is None else (
          e.completion_ids[:n], e.loss_mask[:n], e.logprobs[:n], e.versions[:n])))
      segment = None
      if point.stage == "sample":
        open_segment = partials.get((request.group_id, index))
        if open_segment is None and e is not None:  # restored and not admitted again yet
          open_segment = (e.open_tokens, e.open_logprobs, e.open_versions)
        if open_segment is not None and len(open_segment[0]):
          tokens, logprobs, versions = open_segment
          segment = work_record.OpenSegment(tokens=tuple(int(t) for t in tokens),
                                            logprobs=tuple(float(x) for x in logprobs),
                                            versions=tuple(int(v) for v in versions))
      episodes.append(work_record.EpisodeRecord(
          stage=point.stage, turns=point.turns, last_stopped=point.last_stopped, open=segment,
          **arrays))
    return work_record.GroupRecord(
        group_id=request.group_id, prompt=prompt_to_json(request.prompt),
        prompt_ids=tuple(int(t) for t in request.prompt_ids), attempt=request.attempt,
        dispatch_version=request.dispatch_version, arrival_version=group.arrival_version,
        episodes=tuple(episodes))

  def restore_group(self, record: work_record.GroupRecord, request) -> RestoredGroup:
    """Rebuilds one group of a `snapshot` for `request` (made by the
    dispatcher from the record) and opens it here again."""
    saved = record.episodes
    if len(saved) != request.group_size:
      raise ValueError(f"group {request.group_id} was saved with {len(saved)} rollouts; this "
                       f"run samples groups of {request.group_size} (orchestrator.group_size)")
    to_sample, to_env, scored, points = [], [], [], []
    sampled_versions = []
    for index, item in enumerate(saved):
      if item.held_by is not None:
        raise ValueError(f"group {request.group_id}: rollout {index} was saved without its "
                         f"arrays (held by process {item.held_by})")
      loss_mask = np.asarray(item.loss_mask, np.float32)
      versions = np.asarray(item.versions, np.int32)
      sampled_versions += versions[loss_mask > 0].tolist()
      if item.stage == "done":
        rollout = rollout_lib.Rollout(
            group_id=request.group_id, sample_index=index,
            prompt_ids=np.asarray(request.prompt_ids if item.prompt_ids is None
                                  else item.prompt_ids, np.int32),
            completion_ids=np.asarray(item.completion_ids, np.int32), loss_mask=loss_mask,
            behaviour_logprobs=np.asarray(item.logprobs, np.float32), token_versions=versions,
            dispatch_version=request.dispatch_version, finish_reason=item.finish_reason,
            reward=item.reward, env_name=item.env_name, reward_parts=dict(item.reward_parts),
            outcome=item.outcome)
        scored.append(rollout)
        points.append(_Point("done", rollout=rollout))
        continue
      segment = item.open or work_record.OpenSegment(tokens=(), logprobs=(), versions=())
      sampled_versions += list(segment.versions)
      episode = episode_lib.Episode(
          request=request, sample_index=index, completion_ids=list(item.completion_ids),
          loss_mask=list(item.loss_mask), logprobs=list(item.logprobs),
          versions=list(item.versions), turns=item.turns, last_stopped=item.last_stopped,
          open_tokens=list(segment.tokens), open_logprobs=list(segment.logprobs),
          open_versions=list(segment.versions))
      (to_sample if item.stage == "sample" else to_env).append(episode)
      points.append(_Point(item.stage, episode, len(episode.completion_ids), episode.turns,
                           episode.last_stopped))
    complete = None
    if len(scored) == len(saved):
      complete = rollout_lib.Group(group_id=request.group_id, prompt_id=request.prompt.prompt_id,
                                   dispatch_version=request.dispatch_version, rollouts=scored)
      scored = []
    with self._lock:
      self._groups[request.group_id] = _Group(request=request, points=points,
                                              arrival_version=record.arrival_version)
    return RestoredGroup(group_id=request.group_id, to_sample=to_sample, to_env=to_env,
                         scored=scored, complete=complete,
                         arrival_version=record.arrival_version,
                         oldest_sampled=min(sampled_versions) if sampled_versions else None)


def _arrays(completion_ids, loss_mask, logprobs, versions) -> dict:
  """Per-token fields as plain numbers (float32 log-probs round-trip exactly
  through a double)."""
  return {"completion_ids": tuple(int(t) for t in completion_ids),
          "loss_mask": tuple(float(x) for x in loss_mask),
          "logprobs": tuple(float(x) for x in logprobs),
          "versions": tuple(int(v) for v in versions)}
