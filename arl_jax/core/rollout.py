"""Data contracts of sampled work: `Rollout` and `Group` (docs/design.md section 3).

Versions are always explicit: a missing version is an error, never 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

FINISH_REASONS = ("stop", "length", "cancelled", "error")
# Version recorded for tokens the policy did not sample (prompt, observations, padding).
NO_VERSION = -1


@dataclasses.dataclass(kw_only=True)
class Rollout:
  """One sampled completion with everything needed to train on it off-policy.

  Arrays are over the completion only (length C); the prompt is kept separately.

  Attributes:
    group_id: the group this rollout belongs to.
    sample_index: index within the group, 0..G-1.
    prompt_ids: `[P']` int32 prompt token ids (no padding).
    completion_ids: `[C]` int32 completion token ids (EOS included when stopped).
    loss_mask: `[C]` float32, 1 for tokens the policy sampled, 0 for
      environment/tool tokens.
    behaviour_logprobs: `[C]` float32 log mu(a_t | s_t) recorded at sampling.
    token_versions: `[C]` int32 policy version that sampled each token.
    dispatch_version: live version when the group was dispatched.
    finish_reason: one of FINISH_REASONS.
    reward: scalar reward from the environment (None until scored).
    env_name: environment that scored it.
    timings: seconds spent `queued`, `generating`, `in_env`, `in_buffer`.
    reward_parts: named numbers the reward was made of (`envs/env_api.Score`).
    outcome: how the episode went, in one word, as its environment said
      ("" when it said nothing).
  """

  group_id: int
  sample_index: int
  prompt_ids: np.ndarray
  completion_ids: np.ndarray
  loss_mask: np.ndarray
  behaviour_logprobs: np.ndarray
  token_versions: np.ndarray
  dispatch_version: int
  finish_reason: str
  reward: float | None = None
  env_name: str = ""
  timings: dict[str, float] = dataclasses.field(default_factory=dict)
  reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)
  outcome: str = ""

  def __post_init__(self):
    if self.finish_reason not in FINISH_REASONS:
      raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
    n = len(self.completion_ids)
    for name in ("loss_mask", "behaviour_logprobs", "token_versions"):
      if len(getattr(self, name)) != n:
        raise ValueError(
            f"Rollout.{name} has length {len(getattr(self, name))}, completion has {n}")
    sampled = self.token_versions[self.loss_mask > 0]
    if np.any(sampled < 0):
      raise ValueError(f"Rollout of group {self.group_id}: a sampled token has no version")

  @property
  def version_span(self) -> tuple[int, int]:
    """`(oldest, newest)` version of the sampled tokens (dispatch version if none)."""
    sampled = self.token_versions[self.loss_mask > 0]
    if sampled.size == 0:
      return (self.dispatch_version, self.dispatch_version)
    return (int(sampled.min()), int(sampled.max()))

  @property
  def prompt_length(self) -> int:
    return len(self.prompt_ids)

  @property
  def completion_length(self) -> int:
    return len(self.completion_ids)

  holder = None  # where the per-token arrays are: here (`HeldRollout.holder`)

  def is_masked(self, mask_truncated_completions: bool) -> bool:
    """Whether the learner keeps this rollout out of the loss and of its group's
    baseline: environment faults always, truncated completions on request."""
    return _is_masked(self.finish_reason, mask_truncated_completions)


@dataclasses.dataclass(kw_only=True)
class HeldRollout:
  """What the orchestrator knows of a rollout whose per-token arrays stay in
  the process that sampled it (`holder`, a multi-controller process): its
  metadata, exactly what staleness, assembly policies, the drop ledger and
  the batch plan read (`distributed/shard_plan.py`). The arrays reach the
  learner shard that trains it only when it is trained.

  Attributes (as `Rollout`'s, plus):
    prompt_length, completion_length: token counts of the arrays.
    span: `version_span` of the sampled tokens.
    holder: the process index that holds the arrays.
    copy: the holder's number for this copy of the group
      (`held_groups.HeldGroups.hold`).
  """

  group_id: int
  sample_index: int
  prompt_length: int
  completion_length: int
  span: tuple[int, int]
  dispatch_version: int
  finish_reason: str
  holder: int
  copy: int = 0
  reward: float | None = None
  env_name: str = ""
  timings: dict[str, float] = dataclasses.field(default_factory=dict)
  reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)
  outcome: str = ""

  def __post_init__(self):
    if self.finish_reason not in FINISH_REASONS:
      raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
    if self.prompt_length < 0 or self.completion_length < 0 or self.span[0] > self.span[1]:
      raise ValueError(f"HeldRollout of group {self.group_id}: lengths {self.prompt_length}, "
                       f"{self.completion_length} and version span {self.span} are inconsistent")

  @property
  def version_span(self) -> tuple[int, int]:
    return self.span

  def is_masked(self, mask_truncated_completions: bool) -> bool:
    return _is_masked(self.finish_reason, mask_truncated_completions)


def held_group(group: Group, holder: int, copy: int = 0) -> Group:
  """`group` as process 0 sees it when process `holder` keeps its arrays (as
  `copy`): the same group of `HeldRollout`s."""
  return Group(group_id=group.group_id, prompt_id=group.prompt_id,
               dispatch_version=group.dispatch_version, arrival_version=group.arrival_version,
               rollouts=[HeldRollout(
                   group_id=r.group_id, sample_index=r.sample_index,
                   prompt_length=r.prompt_length, completion_length=r.completion_length,
                   span=r.version_span, dispatch_version=r.dispatch_version,
                   finish_reason=r.finish_reason, holder=holder, copy=copy, reward=r.reward,
                   env_name=r.env_name, timings=dict(r.timings),
                   reward_parts=dict(r.reward_parts), outcome=r.outcome)
                   for r in group.rollouts])


def _is_masked(finish_reason: str, mask_truncated_completions: bool) -> bool:
  return finish_reason == "error" or (mask_truncated_completions and finish_reason == "length")


@dataclasses.dataclass(kw_only=True)
class Group:
  """The G rollouts of one prompt; it trains or is dropped as a unit.

  Attributes:
    group_id: dispatch-order id (unique in a run).
    prompt_id: id of the prompt in its data source.
    dispatch_version: live version when the group was created.
    rollouts: the G rollouts, in sample-index order.
    arrival_version: the live version when the group entered the rollout
      buffer (set by the buffer); splits its lag into versions that passed
      while it was in flight and while it waited to be cut.
  """

  group_id: int
  prompt_id: int
  dispatch_version: int
  rollouts: list[Rollout] | list[HeldRollout]
  arrival_version: int | None = None

  @property
  def holder(self) -> int | None:
    """The process that holds the rollouts' arrays (None: this one)."""
    return self.rollouts[0].holder if self.rollouts else None

  @property
  def oldest_version(self) -> int:
    return min(r.version_span[0] for r in self.rollouts)

  @property
  def rewards(self) -> np.ndarray:
    if any(r.reward is None for r in self.rollouts):
      raise ValueError(f"group {self.group_id} has unscored rollouts")
    return np.array([r.reward for r in self.rollouts], np.float32)
