"""`EnginePort`: the sampler engine's request source and segment sink for
served requests.

Every served segment enters the engine the way a multi-turn episode comes
back from its environment (`SamplerEngine.resume`): a new conversation as an
episode with no completion yet, a session's next turn as its previous
episode with the rendered new messages appended as observation tokens, so
the turn's context is the previous turn's exact tokens. Each segment is its
own group of one (`n` choices are `n` groups; their identical contexts still
share one prefill, `admission.py`), and every segment gets a new group id: a
cancelled group stays cancelled in the engine, and a session may branch from
any earlier turn. Each segment's end resolves a
`concurrent.futures.Future` with its episode (the engine thread never waits
on the web server's event loop); a segment whose client left is cancelled in
the engine at once and its future fails with `Cancelled`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import threading
import time

from arl_jax.core import episode as episode_lib
from arl_jax.core import group_request as group_request_lib


class Cancelled(Exception):
  """The segment was cancelled before it ended (its client left, or the server stops)."""


@dataclasses.dataclass(frozen=True)
class ServedPrompt:
  """The prompt record of a served request (`GroupRequest.prompt`).

  Attributes:
    stop_ids: the stop tokens that end its segments (None: every stop token
      of the sampler); a request's `stop_token_ids`.
    session_id: the session it belongs to ("" for none), for the logs.
    owner_group: the training group whose rollout the session is (None:
      not a training rollout); the versions its tokens are sampled with
      count toward that group's staleness (`note_sampling_fn`).
  """

  stop_ids: tuple[int, ...] | None = None
  session_id: str = ""
  owner_group: int | None = None


class EnginePort:
  """See the module docstring. Thread-safe; `take`, `note_sampling` and
  `segment_ended` are the engine thread's side."""

  def __init__(self, *, version_fn=lambda: 0, note_sampling_fn=None):
    """Args:
      version_fn: the live version a new conversation is dispatched at (a
        run's newest; 0 for a fixed model).
      note_sampling_fn: `(owner_group, version)`, told the version of every
        token sampled for a training rollout's session (a run's
        `Dispatcher.note_sampling`); None: nobody.
    """
    self._version_fn = version_fn
    self._note_sampling_fn = note_sampling_fn
    self._cond = threading.Condition()
    self._futures: dict[int, concurrent.futures.Future] = {}  # group id -> its open segment
    self._owners: dict[int, int] = {}  # group id of an open segment -> its training group
    self._streams: dict[int, object] = {}  # group id -> fn(tokens) of a streamed segment
    self._ids = itertools.count()
    self._engine = None
    self._closed = False

  def attach(self, engine) -> None:
    """The engine this port feeds (built with this port as its `dispatcher`
    and `segment_ended` as its `on_segment_fn`, `multi_turn=True`)."""
    self._engine = engine

  # -- the engine's side ---------------------------------------------------------------

  def take(self, max_groups: int, live_version: int, timeout: float) -> list:
    """No group comes this way (segments are handed to the engine directly);
    an idle engine waits here until one is."""
    with self._cond:
      if timeout > 0 and not self._closed:
        self._cond.wait(timeout)
    return []

  def note_sampling(self, group_id: int, version: int) -> None:
    if self._note_sampling_fn is not None:
      with self._cond:
        owner = self._owners.get(group_id)
      if owner is not None:
        self._note_sampling_fn(owner, version)

  def streaming_groups(self) -> set:
    """The engine's `ProgressSink` side: the segments streamed."""
    with self._cond:
      return set(self._streams) if self._streams else set()

  def segment_progress(self, group_id: int, tokens, logprobs, versions) -> None:
    with self._cond:
      fn = self._streams.get(group_id)
    if fn is not None:
      fn(list(tokens))

  def segment_ended(self, episode: episode_lib.Episode) -> None:
    """The engine's `on_segment_fn`: resolves the segment's future (one
    cancelled meanwhile is dropped)."""
    with self._cond:
      future = self._futures.pop(episode.group_id, None)
      self._owners.pop(episode.group_id, None)
      self._streams.pop(episode.group_id, None)
    if future is not None and not future.done():
      future.set_result(episode)

  # -- the gateway's side --------------------------------------------------------------

  def new_episode(self, prompt_ids, *, prompt: ServedPrompt, draw_id: int | None = None,
                  budget: int | None = None) -> episode_lib.Episode:
    """A conversation's episode before its first segment. `budget`: the
    most completion tokens it may hold, observations included (None: the
    sampler's); `draw_id`: its draws' key (a request's seed)."""
    request = group_request_lib.GroupRequest(
        group_id=self.new_group_id(), prompt=prompt,
        prompt_ids=tuple(int(t) for t in prompt_ids), dispatch_version=self._version_fn(),
        group_size=1, dispatch_time=time.monotonic(), max_new_tokens=budget, draw_id=draw_id)
    return episode_lib.Episode(request=request, sample_index=0)

  def fork(self, episode: episode_lib.Episode, *, prompt: ServedPrompt | None = None,
           draw_id: int | None = None) -> episode_lib.Episode:
    """A copy of `episode` under a new group id (what a next turn extends:
    the session keeps the original)."""
    request = dataclasses.replace(
        episode.request, group_id=self.new_group_id(), draw_id=draw_id,
        prompt=episode.request.prompt if prompt is None else prompt)
    return dataclasses.replace(
        episode, request=request, completion_ids=list(episode.completion_ids),
        loss_mask=list(episode.loss_mask), logprobs=list(episode.logprobs),
        versions=list(episode.versions), open_tokens=[], open_logprobs=[], open_versions=[],
        timings=dict(episode.timings), segment_limit=None)

  def submit(self, episode: episode_lib.Episode, *, max_tokens: int | None,
             on_tokens=None) -> concurrent.futures.Future:
    """Hands `episode` (which the caller holds, and no longer touches) to the
    engine for its next segment of at most `max_tokens` tokens; the future
    resolves with it when the segment ends. `on_tokens(tokens)`: told the
    segment's tokens so far after each engine iteration (on the engine
    thread; a stream), None: not.

    Raises:
      ValueError: it has no completion budget left (`EngineConfig.check_budget_left`).
      Cancelled: the port is closed.
    """
    episode.segment_limit = max_tokens
    future = concurrent.futures.Future()
    with self._cond:
      if self._closed:
        raise Cancelled("the gateway is shutting down")
      self._futures[episode.group_id] = future
      if episode.request.prompt.owner_group is not None:
        self._owners[episode.group_id] = episode.request.prompt.owner_group
      if on_tokens is not None:
        self._streams[episode.group_id] = on_tokens
    try:
      self._engine.resume(episode)
    except BaseException:
      with self._cond:
        self._futures.pop(episode.group_id, None)
        self._owners.pop(episode.group_id, None)
        self._streams.pop(episode.group_id, None)
      raise
    with self._cond:
      self._cond.notify_all()  # (an idle engine waits in `take`)
    return future

  def new_group_id(self) -> int:
    with self._cond:
      return next(self._ids)

  def cancel(self, group_ids) -> None:
    """Cancels the open segments of `group_ids`: the engine frees their
    slots before its next step, and their futures fail with `Cancelled`."""
    group_ids = set(group_ids)
    with self._cond:
      futures = [self._futures.pop(g) for g in group_ids if g in self._futures]
      for g in group_ids:
        self._owners.pop(g, None)
        self._streams.pop(g, None)
    if self._engine is not None and group_ids:
      self._engine.cancel(group_ids)
    for future in futures:
      if not future.done():
        future.set_exception(Cancelled(f"segments of groups {sorted(group_ids)} were cancelled"))

  def close(self) -> None:
    """Cancels every open segment; later submissions raise `Cancelled`."""
    with self._cond:
      self._closed = True
      open_ids = list(self._futures)
      self._cond.notify_all()
    self.cancel(open_ids)

  @property
  def open_segments(self) -> int:
    """Segments handed to the engine and not yet ended."""
    with self._cond:
      return len(self._futures)
