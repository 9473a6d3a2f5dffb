"""The orchestrator's settings: the config's `orchestrator` section.

One dataclass declares every key (its default, its doc, its check), and the
orchestrator, its dispatcher and its buffer each take it whole: they share
the staleness bound, its reference and the batch's shape, and a key is
declared once. What they derive from it (`groups_per_batch`, `capacity`,
`window_groups`) are its properties.
"""

from __future__ import annotations

import dataclasses

from arl_jax.core import settings
from arl_jax.orchestrator import adaptive_staleness, staleness

ASSEMBLY_POLICIES = ("fifo", "windowed_fifo", "first_done")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrchestratorConfig:
  """The `orchestrator` section (dispatcher, buffer: `orchestrator/`).

  Attributes:
    batch_size: rollouts per learner batch (a multiple of group_size).
    group_size: G, rollouts sampled per prompt (the baseline of
      group-relative advantages).
    max_async_level: batches the sampler may run ahead of the learner
      (admission control; 0: synchronous).
    max_off_policy_steps: K, the staleness bound: a group whose lag exceeds it
      when a batch is cut is dropped, and in-flight groups that can no longer
      ship are cancelled (staleness.policy="adaptive": the K it starts at).
    staleness_reference: what a group's lag is counted from: "dispatch" (the
      version it was dispatched under) or "oldest_token".
    assembly: how batches are cut from finished groups: "fifo",
      "windowed_fifo" or "first_done" (`ASSEMBLY_POLICIES`, `buffer.py`).
    window_fraction: windowed_fifo: the window, as a fraction of a batch.
    requeue_dropped: times a dropped group's prompt is dispatched again.
    mask_truncated_completions: completions cut at the budget train no tokens.
    filter_zero_variance: dynamic sampling (DAPO): a group whose trainable
      rollouts' rewards do not differ is dropped as it finishes, and more
      groups are admitted so batches stay full (`zero_variance.py`).
    overlong_buffer: the soft overlong penalty's buffer, in tokens: a
      completion that ends in the last this-many tokens of the budget loses
      reward linearly, up to overlong_penalty at the budget
      (`reward_shaping.py`; 0: off).
    overlong_penalty: the penalty at the budget.
    staleness: how K is chosen: the `orchestrator.staleness` section
      (`adaptive_staleness.StalenessPolicy`).
  """

  batch_size: int
  group_size: int
  max_async_level: int = 1
  max_off_policy_steps: int = 8
  staleness_reference: str = "dispatch"
  assembly: str = "fifo"
  window_fraction: float = 0.3
  requeue_dropped: int = 0
  mask_truncated_completions: bool = False
  filter_zero_variance: bool = False
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0
  staleness: adaptive_staleness.StalenessPolicy = settings.derived(
      adaptive_staleness.StalenessPolicy(), "orchestrator.staleness")

  def __post_init__(self):
    g, batch = self.group_size, self.batch_size
    settings.check(settings.is_int(g) and g >= 2, "group_size",
                   f"must be an int >= 2 (group-relative advantages need a baseline), got {g!r}")
    settings.check(settings.is_int(batch) and batch > 0 and batch % g == 0, "batch_size",
                   f"{batch!r} rollouts is not a positive int multiple of "
                   f"orchestrator.group_size={g}")
    settings.check(settings.is_int(self.max_off_policy_steps) and self.max_off_policy_steps >= 0,
                   "max_off_policy_steps", f"K must be >= 0 (an int), got "
                   f"{self.max_off_policy_steps!r}")
    settings.check(settings.is_int(self.max_async_level) and self.max_async_level >= 0,
                   "max_async_level", f"must be an int >= 0, got {self.max_async_level!r}")
    settings.check(self.staleness_reference in staleness.REFERENCES, "staleness_reference",
                   f"must be one of {staleness.REFERENCES}, got {self.staleness_reference!r}")
    settings.check(self.assembly in ASSEMBLY_POLICIES, "assembly",
                   f"must be one of {ASSEMBLY_POLICIES}, got {self.assembly!r}")
    settings.check(0.0 < self.window_fraction <= 1.0, "window_fraction",
                   f"must be in (0, 1], got {self.window_fraction}")
    settings.check(settings.is_int(self.requeue_dropped) and self.requeue_dropped >= 0,
                   "requeue_dropped", f"must be an int >= 0 (times a dropped prompt is "
                   f"dispatched again), got {self.requeue_dropped!r}")
    settings.check(isinstance(self.mask_truncated_completions, bool),
                   "mask_truncated_completions",
                   f"must be True or False, got {self.mask_truncated_completions!r}")
    settings.check(isinstance(self.filter_zero_variance, bool), "filter_zero_variance",
                   f"must be True or False, got {self.filter_zero_variance!r}")
    settings.check(settings.is_int(self.overlong_buffer) and self.overlong_buffer >= 0,
                   "overlong_buffer", f"must be an int >= 0 (tokens; 0: off), got "
                   f"{self.overlong_buffer!r}")
    settings.check(isinstance(self.overlong_penalty, (int, float)) and self.overlong_penalty > 0,
                   "overlong_penalty", f"must be > 0, got {self.overlong_penalty!r}")
    bounds = self.staleness
    settings.check(not bounds.adaptive
                   or bounds.k_min <= self.max_off_policy_steps <= bounds.k_max,
                   "max_off_policy_steps", f"{self.max_off_policy_steps!r}: under "
                   f"staleness.policy='adaptive' K starts here, which must lie in "
                   f"[staleness.k_min, staleness.k_max] = [{bounds.k_min}, {bounds.k_max}]")

  @property
  def groups_per_batch(self) -> int:
    return self.batch_size // self.group_size

  @property
  def capacity(self) -> int:
    """Groups admission lets into the system (started, not yet retired)."""
    return (self.max_async_level + 1) * self.groups_per_batch

  def capacity_at(self, k: int) -> int:
    """The capacity while the bound is `k`. Under the adaptive policy with
    `pace_admissions`, at most `k + 1` batches of groups: a group admitted
    behind `k + 1` batches' worth of others joins `B_{v + k + 1}` or a later
    one in dispatch order, at a lag above `k`, so admitting it only makes a
    drop. (The fixed policy keeps `capacity`, as it always had.)"""
    if not (self.staleness.adaptive and self.staleness.pace_admissions):
      return self.capacity
    return (min(self.max_async_level, k) + 1) * self.groups_per_batch

  @property
  def window_groups(self) -> int:
    """windowed_fifo's window in whole groups (at least one)."""
    return max(1, round(self.window_fraction * self.groups_per_batch))
