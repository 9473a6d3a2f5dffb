"""The staleness rule: how old a group is when it would train, and whether it may.

A group in batch `B_u` (the batch that updates version `u` into `u + 1`) has
lag `u - reference`, where the reference is its dispatch version (default; the
group ages as a unit, as prime-rl) or the oldest version among its sampled
tokens (`oldest_token`). It may train only if `lag <= K`. Time spent waiting in
the buffer counts, because `u` keeps growing while the group waits.
"""

from __future__ import annotations

from arl_jax.core import rollout as rollout_lib

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


def can_still_ship(reference: int | None, live_version: int, max_off_policy_steps: int) -> bool:
  """Whether a group still in flight (generating or in its environment) may
  train in some future batch.

  Once `live_version` is published the earliest batch the group can join is
  `B_{live_version}`, and its lag there is `live_version - reference`, where
  `reference` is the version its lag counts from (`in_flight_reference`). The
  lag only grows, so when it already exceeds K the group can never ship and
  generating it further only wastes compute. `reference=None` means the group
  has no sampled token yet under `oldest_token`: it is not cancelled, because
  it will usually be admitted under the live version. (A sampler that has not
  swapped yet may still admit it one version behind; then the next publish
  cancels it, and the buffer's sweep keeps it out of any batch meanwhile.)
  """
  return reference is None or live_version - reference <= max_off_policy_steps


def in_flight_reference(dispatch_version: int, oldest_sampled: int | None,
                        reference: str) -> int | None:
  """The version an in-flight group's lag counts from, as far as known now.

  Under `dispatch` that is fixed at dispatch. Under `oldest_token` it is the
  oldest version among the tokens sampled so far: versions only grow, so every
  later token is at least as new, and the final oldest version is this one
  (`None` while nothing is sampled).
  """
  if reference == "dispatch":
    return dispatch_version
  if reference == "oldest_token":
    return oldest_sampled
  raise ValueError(f"staleness_reference must be one of {REFERENCES}, got {reference!r}")
