"""Dynamic sampling (DAPO, Yu et al., 2025): groups whose rewards do not
differ are dropped on arrival, and the dispatcher keeps more groups in flight
so that batches stay full of groups that train.

A group-relative advantage (`grpo`, `grpo_no_std`, `rloo`,
`reinforce_pp_baseline`) is 0 on every rollout of a group whose rewards are
equal (all right or all wrong), so such a group trains nothing but takes a
batch slot. With `orchestrator.filter_zero_variance` the orchestrator drops
it the moment it finishes (drop reason `zero_variance`, a
`dropped_zero_variance` event in `groups.jsonl`), without requeueing its
prompt (it would most likely come back the same). The rewards compared are
those of the rollouts that would train: masked ones (environment faults;
truncated completions when masked) are left out, and a group with fewer
than two of them is dropped too.

Keeping batches full: a dropped group retires at once and frees its
admission slot, and admission counts each group in flight as the kept
fraction of the recent arrivals (at least 1 / `MAX_SCALE`), so the groups
that will ship, finished ones plus the expected yield of those in flight,
stay about the `(max_async_level + 1)` batches admission control intends:
more groups are generated, and the lag stays close to the unfiltered run's
(the replay in `tests/orchestrator/zero_variance_test.py`, a third of the
groups kept: 1.5 against 1.0 versions; the kept share of the many groups in
flight varies). The kept
fraction is a metric (`zero_variance_kept_fraction`, over the run; the recent
one the dispatcher uses is `admission_yield`).

No signal at all: when `no_signal_groups` groups in a row are dropped (every
sample right, or every one wrong), the run stops with a message that says so
(`orchestrator.NoSignal`) instead of sampling forever.
"""

from __future__ import annotations

import collections

from arl_jax.core import rollout as rollout_lib

# At most this many groups are in flight per group expected to ship (a task
# where nearly every group is solved or failed would otherwise flood the sampler).
MAX_SCALE = 4.0


def carries_signal(group: rollout_lib.Group, mask_truncated_completions: bool) -> bool:
  """Whether at least two of the group's trainable rollouts differ in reward."""
  # (two distinct rewards need two rollouts: no separate count)
  rewards = {float(r.reward) for r in group.rollouts
             if not r.is_masked(mask_truncated_completions)}
  return len(rewards) >= 2


def no_signal_groups(groups_per_batch: int) -> int:
  """Groups dropped in a row after which a run gives up: 16 batches' worth,
  at least 256."""
  return max(256, 16 * groups_per_batch)


class KeptFraction:
  """The kept share of the groups that finished: over the run (the metric)
  and over the last `window` arrivals (what the capacity follows)."""

  def __init__(self, window: int):
    self._recent: collections.deque[bool] = collections.deque(maxlen=max(window, 1))
    self.kept = 0
    self.dropped = 0
    self.dropped_in_a_row = 0

  def add(self, kept: bool) -> None:
    self._recent.append(kept)
    if kept:
      self.kept += 1
      self.dropped_in_a_row = 0
    else:
      self.dropped += 1
      self.dropped_in_a_row += 1

  @property
  def overall(self) -> float:
    return self.kept / max(self.kept + self.dropped, 1)

  def expected_yield(self) -> float:
    """The recent kept fraction, at least 1 / MAX_SCALE (1 before any arrival)."""
    if not self._recent:
      return 1.0
    return max(sum(self._recent) / len(self._recent), 1.0 / MAX_SCALE)

  def to_json(self) -> dict:
    return {"kept": self.kept, "dropped": self.dropped}

  def restore(self, record: dict) -> None:
    self.kept, self.dropped = int(record["kept"]), int(record["dropped"])

