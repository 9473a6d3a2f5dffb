"""The staleness rule: how old a group is when it would train, and whether it may.

A group in batch `B_u` (the batch that updates version `u` into `u + 1`) has
lag `u - reference`, where the reference is its dispatch version (default; the
group ages as a unit, as prime-rl) or the oldest version among its sampled
tokens (`oldest_token`). It may train only if `lag <= K`. Time spent waiting in
the buffer counts, because `u` keeps growing while the group waits.
"""

from __future__ import annotations

from arl_jax import rollout as rollout_lib

REFERENCES = ("dispatch", "oldest_token")


def reference_version(group: rollout_lib.Group, reference: str) -> int:
  if reference == "dispatch":
    return group.dispatch_version
  if reference == "oldest_token":
    return group.oldest_version
  raise ValueError(f"staleness_reference must be one of {REFERENCES}, got {reference!r}")


def lag(batch_version: int, group: rollout_lib.Group, reference: str) -> int:
  """Lag of `group` if it trained in `B_{batch_version}`."""
  return batch_version - reference_version(group, reference)


def is_stale(batch_version: int, group: rollout_lib.Group, max_off_policy_steps: int,
             reference: str) -> bool:
  return lag(batch_version, group, reference) > max_off_policy_steps


def can_still_ship(dispatch_version: int, live_version: int, max_off_policy_steps: int) -> bool:
  """Whether a group still generating may train in some future batch.

  Once `live_version` is published the earliest batch the group can join is
  `B_{live_version}`. The sampler samples a group's first token with the
  params live at dispatch, so its oldest token version equals its dispatch
  version and the lag is the same under either reference: when
  `live_version - dispatch_version > K` it can never ship, and generating it
  further only wastes compute. (A sampler that re-admits work under newer
  weights must cancel on the oldest recorded version instead.)
  """
  return live_version - dispatch_version <= max_off_policy_steps
