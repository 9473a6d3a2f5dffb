"""`Episode`: one rollout while it is being produced, turn by turn.

A single-turn rollout is one segment sampled by the engine. A multi-turn one
alternates segments the policy samples (loss mask 1, each token with its
behaviour log-prob and version) with observation tokens an environment appends
(loss mask 0, no log-prob, no version). Between turns the episode leaves its
sampler slot, so a slow tool never holds one; the engine re-admits it with the
whole context re-prefilled under the weights live at that moment.

Ownership passes hands (engine thread -> env worker -> engine thread) through
locked queues, never shared: at any moment exactly one thread mutates an episode.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from arl_jax.core import rollout as rollout_lib


@dataclasses.dataclass(eq=False, kw_only=True)
class Episode:
  """Attributes:
    request: the group request it belongs to (a `group_request.GroupRequest`).
    sample_index: index within the group, 0..G-1.
    completion_ids: every token after the prompt so far (segments and observations).
    loss_mask: 1.0 for sampled tokens, 0.0 for observation tokens.
    logprobs: behaviour log-prob of sampled tokens, 0.0 for observations.
    versions: version that sampled each token, rollout.NO_VERSION for observations.
    turns: segments sampled so far.
    last_stopped: whether the last segment ended on a stop token (EOS or
      another stop id), as opposed to running out of budget.
    open_tokens, open_logprobs, open_versions: the start of a segment that was
      being sampled when the run was checkpointed (`open_work.py`); a resume
      re-admits the episode with them in its context and the engine continues
      the segment after them, so they join the segment when it ends.
    timings: seconds `queued` (waiting for a slot, all turns), `generating`
      (in a slot), `in_env` (environment calls, tool latency included).
    segment_limit: the most tokens the next segment may sample (None: what
      the budget leaves); a gateway request's `max_tokens`.
    last_alternatives: `(top_ids [n, K], top_logprobs [n, K])`, the most
      likely alternatives of the last segment's n tokens when the sampler
      records them (`SamplingSettings.top_logprobs`; a served answer's
      `top_logprobs`), else None. Not saved with the episode.
    open_alternatives: the same for the open segment of a preempted one.
  """

  request: object
  sample_index: int
  completion_ids: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[float] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  turns: int = 0
  last_stopped: bool = False
  open_tokens: list[int] = dataclasses.field(default_factory=list)
  open_logprobs: list[float] = dataclasses.field(default_factory=list)
  open_versions: list[int] = dataclasses.field(default_factory=list)
  timings: dict[str, float] = dataclasses.field(
      default_factory=lambda: {"queued": 0.0, "generating": 0.0, "in_env": 0.0})
  segment_limit: int | None = None
  last_alternatives: tuple | None = None
  open_alternatives: tuple | None = None

  @property
  def group_id(self) -> int:
    return self.request.group_id

  @property
  def prompt_ids(self) -> tuple[int, ...]:
    return self.request.prompt_ids

  def budget(self, default: int) -> int:
    """Completion tokens the episode may hold: its prompt's own budget, capped
    at the sampler's `default`."""
    return self.request.budget(default)

  def budget_left(self, default: int) -> int:
    """Completion tokens the episode's next segment may sample (`budget` less
    what it holds), at most `segment_limit`."""
    left = self.budget(default) - self.length
    return left if self.segment_limit is None else min(left, self.segment_limit)

  @property
  def length(self) -> int:
    """Completion tokens held so far, an open segment's included (they count
    against the budget)."""
    return len(self.completion_ids) + len(self.open_tokens)

  def context_ids(self) -> list[int]:
    """Prompt, completion and open segment so far: what a re-admission prefills."""
    return [*self.prompt_ids, *self.completion_ids, *self.open_tokens]

  def add_segment(self, tokens, logprobs, versions, *, stopped: bool,
                  alternatives: tuple | None = None) -> None:
    """Appends tokens the policy sampled, with their behaviour log-probs and
    versions (a whole segment: an open segment's tokens are its first ones,
    and their `open_alternatives` replace what `alternatives` holds for them)."""
    n = len(tokens)
    if len(logprobs) != n or len(versions) != n:
      raise ValueError(f"segment of {n} tokens has {len(logprobs)} log-probs and "
                       f"{len(versions)} versions")
    if n and min(int(v) for v in versions) < 0:
      raise ValueError(f"group {self.group_id}: a sampled token has no version")
    self.completion_ids.extend(int(t) for t in tokens)
    self.loss_mask.extend([1.0] * n)
    self.logprobs.extend(float(x) for x in logprobs)
    self.versions.extend(int(v) for v in versions)
    self.turns += 1
    self.last_stopped = stopped
    self.last_alternatives = self.with_open_alternatives(alternatives)
    self.open_tokens, self.open_logprobs, self.open_versions = [], [], []
    self.open_alternatives = None

  def with_open_alternatives(self, alternatives: tuple | None) -> tuple | None:
    """A re-admitted segment's alternatives as read (`[n, K]` each, whose first
    rows, the open segment's, the slot never sampled) with the open segment's
    own in those rows."""
    if alternatives is None or self.open_alternatives is None:
      return alternatives
    ids, logps = (np.array(a) for a in alternatives)
    kept = len(self.open_alternatives[0])
    ids[:kept], logps[:kept] = self.open_alternatives
    return ids, logps

  def drop_sampled_tail(self, n: int) -> None:
    """Forgets the last `n` tokens of the last segment (a gateway's stop
    string ended the answer before them): they were sampled but are not part
    of the trajectory, so nothing trains on them and the next turn's context
    goes on from the tokens kept."""
    if n == 0:
      return
    if not 0 < n <= len(self.loss_mask) or min(self.loss_mask[-n:]) < 1.0:
      raise ValueError(f"group {self.group_id}: cannot drop {n} tokens: the last segment is "
                       "shorter")
    for held in (self.completion_ids, self.loss_mask, self.logprobs, self.versions):
      del held[-n:]
    if self.last_alternatives is not None:
      self.last_alternatives = tuple(a[:len(a) - n] for a in self.last_alternatives)
    self.last_stopped = False

  def add_observation(self, tokens) -> None:
    """Appends environment tokens (never trained on)."""
    n = len(tokens)
    self.completion_ids.extend(int(t) for t in tokens)
    self.loss_mask.extend([0.0] * n)
    self.logprobs.extend([0.0] * n)
    self.versions.extend([rollout_lib.NO_VERSION] * n)

  def to_rollout(self, *, finish_reason: str, reward: float | None = None,
                 env_name: str = "", reward_parts=None, outcome: str = "") -> rollout_lib.Rollout:
    return rollout_lib.Rollout(
        group_id=self.group_id, sample_index=self.sample_index,
        prompt_ids=np.asarray(self.prompt_ids, np.int32),
        completion_ids=np.asarray(self.completion_ids, np.int32),
        loss_mask=np.asarray(self.loss_mask, np.float32),
        behaviour_logprobs=np.asarray(self.logprobs, np.float32),
        token_versions=np.asarray(self.versions, np.int32),
        dispatch_version=self.request.dispatch_version, finish_reason=finish_reason,
        reward=reward, env_name=env_name, timings=dict(self.timings),
        reward_parts=dict(reward_parts or {}), outcome=outcome)
