"""What the orchestrator hands the sampler for one group: the contract between
the two roles (the dispatcher makes requests, the sampler's engine, a remote
sampler's wire and synchronous generation read them)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GroupRequest:
  """What the sampler needs to generate one group.

  Attributes:
    group_id: dispatch-order id (unique in a run).
    prompt: the environment's prompt record.
    prompt_ids: the prompt's token ids.
    dispatch_version: the live version when the group was created.
    group_size: rollouts of the group (G).
    dispatch_time: when it was dispatched (the dispatcher's clock).
    attempt: how many dropped groups of this prompt were dispatched before it.
    max_new_tokens: the prompt's own completion budget
      (`Environment.max_new_tokens_for`), None: the sampler's.
    draw_id: what its random draws are keyed by in place of `group_id`
      (None: the group id); a gateway request's `seed`, so that a seed
      repeats its samples.
  """

  group_id: int
  prompt: object
  prompt_ids: tuple[int, ...]
  dispatch_version: int
  group_size: int
  dispatch_time: float
  attempt: int = 0
  max_new_tokens: int | None = None
  draw_id: int | None = None

  @property
  def key_id(self) -> int:
    """The id the PRNG keys of its samples derive from (`token_draw.key_ids`)."""
    return self.group_id if self.draw_id is None else self.draw_id

  def budget(self, default: int) -> int:
    """Completion tokens an episode of this group may hold (observations included)."""
    return default if self.max_new_tokens is None else min(self.max_new_tokens, default)
