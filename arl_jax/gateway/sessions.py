"""Sessions: the conversations whose turns extend each other's exact tokens.

A session is named by its client (the `X-Session-ID` header, the request's
`user` field, or a base URL `/sessions/{id}/v1`). It keeps a `Branch` for
each answer it gave: the messages up to and including that answer (as the
client will send them back), the rendering the answer was sampled after, and
the episode holding every token so far with its behaviour log-prob and
version. A request continues the branch whose messages begin it (the
longest, should several), so a client that retries or tries several answers
(`n`) continues from the one it kept. The store forgets sessions idle
longer than `ttl_s` and, when full, the longest idle.

A session a training run opens for one of its rollouts is *bound* to it
(`SessionStore.bind`): it is never forgotten while bound (its tokens are
training data), its segments count toward the rollout's group for the
staleness bound, and once its group is cancelled (it went stale), its open
segments stop and its next request gets a clear error (`cancelled`).
"""

from __future__ import annotations

import dataclasses
import threading
import time

from arl_jax.core import episode as episode_lib


@dataclasses.dataclass
class Branch:
  """Attributes:
    messages: the conversation through the answer (canonical, `chat_render`);
      empty for a token-in (`generate`) branch.
    tools, template_kwargs: what it was rendered with.
    prompt_text: the rendering the answer was sampled after.
    episode: the prompt, every turn's tokens and the answer's.
    text: a text completion's prompt and answer, as the client holds them
      (what its next prompt begins with); "" for others.
  """

  messages: list[dict]
  tools: list | None
  template_kwargs: dict
  prompt_text: str
  episode: episode_lib.Episode
  text: str = ""

  def continues(self, messages: list[dict], tools, template_kwargs: dict) -> bool:
    """Whether a request with these (canonical) messages goes on from here."""
    n = len(self.messages)
    return (0 < n < len(messages) and messages[:n] == self.messages and tools == self.tools
            and template_kwargs == self.template_kwargs)


@dataclasses.dataclass
class Session:
  """Attributes:
    id: the client's name for it.
    branches: its answers so far, oldest first.
    reward: set by the client (`POST /v1/sessions/{id}/reward`), None before.
    turns, breaks: turns served; turns that could not extend their branch
      exactly (`chat_render.Break`) and began a new episode.
    last_used: `time.monotonic()` of its last request.
    latest: the branch of its last answer (choice 0 of its last request):
      the trajectory a bound session's rollout trains on.
    owner: the `(group_id, sample_index)` of the training rollout it is
      (None: not bound).
    cancelled: why its group was cancelled ("" while it was not).
    open_groups: the engine group ids of its segments being sampled.
  """

  id: str
  branches: list[Branch] = dataclasses.field(default_factory=list)
  reward: float | None = None
  turns: int = 0
  breaks: int = 0
  last_used: float = dataclasses.field(default_factory=time.monotonic)
  latest: Branch | None = None
  owner: tuple[int, int] | None = None
  cancelled: str = ""
  open_groups: set = dataclasses.field(default_factory=set)

  def branch_for(self, messages: list[dict], tools, template_kwargs: dict) -> Branch | None:
    found = [b for b in self.branches if b.continues(messages, tools, template_kwargs)]
    return max(found, key=lambda b: len(b.messages), default=None)

  def branch_for_text(self, text: str) -> Branch | None:
    """The text-completion branch whose prompt and answer `text` begins
    with (the longest)."""
    found = [b for b in self.branches if b.text and len(b.text) < len(text)
             and text.startswith(b.text)]
    return max(found, key=lambda b: len(b.text), default=None)

  def branch_for_ids(self, token_ids: list[int]) -> Branch | None:
    """The branch whose whole context (prompt, turns, answer) `token_ids` extends."""
    found = []
    for branch in self.branches:
      context = branch.episode.context_ids()
      if len(context) < len(token_ids) and token_ids[:len(context)] == context:
        found.append((len(context), branch))
    return max(found, key=lambda x: x[0], default=(0, None))[1]

  def to_json(self) -> dict:
    """Every branch's tokens: what a trainer reads of the session."""
    return {"id": self.id, "turns": self.turns, "breaks": self.breaks, "reward": self.reward,
            "branches": [
                {"prompt_ids": list(b.episode.prompt_ids),
                 "completion_ids": list(b.episode.completion_ids),
                 "loss_mask": list(b.episode.loss_mask),
                 "logprobs": list(b.episode.logprobs), "versions": list(b.episode.versions),
                 "num_messages": len(b.messages)} for b in self.branches]}


class SessionStore:
  """The sessions by id, bounded (thread-safe)."""

  def __init__(self, *, max_sessions: int, max_branches: int, ttl_s: float):
    self._max_sessions, self._max_branches, self._ttl_s = max_sessions, max_branches, ttl_s
    self._sessions: dict[str, Session] = {}
    self._lock = threading.Lock()
    self.evicted = 0

  def get(self, session_id: str, create: bool = True) -> Session | None:
    with self._lock:
      self._forget_idle(time.monotonic())
      session = self._sessions.get(session_id)
      if session is None and create:
        unbound = [s for s in self._sessions.values() if s.owner is None]
        if len(unbound) >= self._max_sessions:
          oldest = min(unbound, key=lambda s: s.last_used)
          del self._sessions[oldest.id]
          self.evicted += 1
        session = self._sessions[session_id] = Session(id=session_id)
      if session is not None:
        session.last_used = time.monotonic()
      return session

  def bind(self, session_id: str, owner: tuple[int, int]) -> Session:
    """Opens session `session_id` for the training rollout `owner`
    (`(group_id, sample_index)`); it is kept until `delete`, or, once
    cancelled, until idle for `ttl_s` (so its agent's late requests read why)."""
    with self._lock:
      if session_id in self._sessions:
        raise ValueError(f"session {session_id!r} exists already")
      session = self._sessions[session_id] = Session(id=session_id, owner=owner)
      return session

  def add_branch(self, session: Session, branch: Branch, *, latest: bool = False) -> None:
    with self._lock:
      session.branches.append(branch)
      del session.branches[:-self._max_branches]
      if latest:
        session.latest = branch

  def delete(self, session_id: str) -> bool:
    with self._lock:
      return self._sessions.pop(session_id, None) is not None

  def __len__(self) -> int:
    with self._lock:
      return len(self._sessions)

  def _forget_idle(self, now: float) -> None:
    idle = [k for k, s in self._sessions.items()
            if (s.owner is None or s.cancelled) and now - s.last_used > self._ttl_s]
    for key in idle:
      del self._sessions[key]
    self.evicted += len(idle)
