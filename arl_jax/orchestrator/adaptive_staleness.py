"""The staleness bound K set from measured off-policyness (the `adaptive` policy).

Under `orchestrator.staleness.policy = "fixed"` K is `max_off_policy_steps`
for the whole run. Under `"adaptive"` it starts there and moves inside
`[k_min, k_max]` by the rule below, from what the learner measured on the
batches it trained: per token-lag bucket (`learner/update.LAG_BUCKETS`), the
normalised effective sample size `ESS = E[rho]^2 / E[rho^2]` of the token
importance ratios `rho = pi_prox / mu`, the policy at the start of the batch
over the behaviour policy (`losses.ratio_statistics`; 1 when the ratios are
equal, toward 0 as a few tokens carry all the weight).

The rule, once per learner update (`AdaptiveBound.observe`):

1. Smooth: each bucket with at least `min_tokens` trained tokens at lag >= 1
   updates its exponential average, `s <- (1 - a) s + a ESS` (`a =
   smoothing`; the first measurement starts it). A bucket not measured in
   this update is forgotten: lags beyond K are never trained, and what was
   measured of them under an older policy says little of the current one.
2. The first failing lag `l*` is the smallest lag of a bucket whose average
   is below `ess_target`; the supported bound is `l* - 1` (`k_max` when no
   bucket fails), clamped to `[k_min, k_max]`.
3. Tighten at once to the supported bound when it is below K; loosen by one
   lag only after `loosen_after` updates in a row in which every measured
   lag passed with room to spare: at or above `ess_target + loosen_margin`
   (between the two it holds, the streak starting over), and only once lag
   K itself has been measured (its bucket): a probe is confirmed before the
   next one. Lags never measured are unknown: they neither fail nor pass,
   so loosening probes one lag beyond what was measured, and the next
   measurement of that lag confirms it or takes it back. (Additive increase,
   immediate decrease, as TCP's congestion window: drift shows up as a
   collapse at the largest lags first, and training on collapsed weights
   costs more than a batch that waits.) The wait and the margin are
   hysteresis. Without the wait, K rose to `k_max` while the pipeline's
   lag was still filling (the large lags not yet trained, so nothing could
   fail), then fell from 8 to 4 at once when they were, dropping every
   group sampled for the looser bound: on arith a sawtooth of ~18 updates
   that dropped ~20% of the rollouts as stale (benchmarks/README.md). The
   margin keeps a K whose own lag only just passes from probing one that
   would fail and be taken back.

Lag 0 is left out: its ratios differ from 1 by the trainer/inference
mismatch alone, which no bound on staleness changes (`ess_target` must sit
below the lag-0 ESS, `ess_lag0` in the metrics, or K stays at `k_min`).

When the bound applies: a decision taken from update `u`'s statistics (on the
host only after `u + 1` is published) takes effect at the next publish
(`apply`), so one bound governs everything about a version: the cancellation
at its publish, every cut of its batch and the admissions while it is live;
a checkpoint of that version holds it, and a resume continues with it.

Follows and departs: the ESS as the measure of how far importance weights
can be trusted is Kong (1992) and Owen (2013, ch. 9). M2PO (Zheng et al.,
2025, "Prosperity before Collapse") reads the second moment `E[log(rho)^2]`
of a batch to mask its most off-policy tokens at a fixed staleness; here the
same kind of measurement (the ESS, a function of `E[rho^2]` and `E[rho]`)
sets the staleness itself, per lag, and masks nothing. AReaL (Fu et al.,
2025, `max_head_offpolicyness`) and prime-rl (`max_async_level`) fix the
bound before the run, as the `fixed` policy does. The clip fraction is not
used: the learner measures it over the whole batch, not per lag, so it
cannot say which lag to give up.

Pure Python, no JAX: the orchestrator owns one, and tests drive it alone.
"""

from __future__ import annotations

import dataclasses
import math
import typing

from arl_jax.core import settings

POLICIES = ("fixed", "adaptive")
# What the last decision did, as the number `staleness_k_action` logs (metric
# rows hold numbers only: fleets sum them).
ACTIONS = {"fixed": 0, "hold": 1, "tighten": 2, "loosen": 3}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StalenessPolicy:
  """The `orchestrator.staleness` section: how K is chosen.

  Attributes:
    policy: "fixed" (K is orchestrator.max_off_policy_steps throughout) or
      "adaptive" (K starts at max_off_policy_steps and follows the measured
      ESS per lag inside [k_min, k_max]; `adaptive_staleness.py`).
    k_min: adaptive: the smallest K (an int >= 0).
    k_max: adaptive: the largest K.
    ess_target: adaptive: a lag is trusted while the smoothed normalised ESS
      of its tokens' importance ratios stays at or above this, in (0, 1).
    smoothing: adaptive: the weight of the newest measurement in each lag's
      exponential average, in (0, 1] (1: none).
    loosen_after: adaptive: updates in a row in which every measured lag
      passed with `loosen_margin` to spare before K grows by one (an int >= 1).
    loosen_margin: adaptive: how far above `ess_target` every measured lag's
      smoothed ESS must be for K to grow, in [0, 1 - ess_target).
    min_tokens: adaptive: trained tokens a lag bucket needs in one update for
      its ESS to count (fewer: not measured).
    pace_admissions: adaptive: admission lets at most (min(max_async_level,
      K) + 1) batches of groups into the system, so a tighter K starts fewer
      groups that could only be dropped (False: K only drops and cancels).
  """

  policy: str = "fixed"
  k_min: int = 1
  k_max: int = 8
  ess_target: float = 0.9
  smoothing: float = 0.5
  loosen_after: int = 2
  loosen_margin: float = 0.03
  min_tokens: int = 64
  pace_admissions: bool = True

  def __post_init__(self):
    settings.check(self.policy in POLICIES, "policy",
                   f"must be one of {POLICIES}, got {self.policy!r}")
    settings.check(settings.is_int(self.k_min) and self.k_min >= 0, "k_min",
                   f"must be an int >= 0, got {self.k_min!r}")
    settings.check(settings.is_int(self.k_max) and self.k_max >= self.k_min, "k_max",
                   f"must be an int >= k_min={self.k_min!r}, got {self.k_max!r}")
    settings.check(isinstance(self.ess_target, (int, float)) and 0 < self.ess_target < 1,
                   "ess_target", f"must be in (0, 1), got {self.ess_target!r}")
    settings.check(isinstance(self.smoothing, (int, float)) and 0 < self.smoothing <= 1,
                   "smoothing", f"must be in (0, 1], got {self.smoothing!r}")
    settings.check(settings.is_int(self.loosen_after) and self.loosen_after >= 1,
                   "loosen_after", f"must be an int >= 1, got {self.loosen_after!r}")
    settings.check(isinstance(self.loosen_margin, (int, float))
                   and 0 <= self.loosen_margin < 1 - self.ess_target, "loosen_margin",
                   f"must be in [0, 1 - ess_target={1 - self.ess_target:g}), "
                   f"got {self.loosen_margin!r}")
    settings.check(settings.is_int(self.min_tokens) and self.min_tokens >= 1, "min_tokens",
                   f"must be an int >= 1, got {self.min_tokens!r}")
    settings.check(isinstance(self.pace_admissions, bool), "pace_admissions",
                   f"must be True or False, got {self.pace_admissions!r}")

  @property
  def adaptive(self) -> bool:
    return self.policy == "adaptive"


class LagStat(typing.NamedTuple):
  """What the learner measured of one token-lag bucket `[lo, hi]` in one update."""

  lo: int
  hi: int
  ess: float  # normalised ESS of the bucket's token importance ratios
  tokens: float  # trained tokens in the bucket


@dataclasses.dataclass(frozen=True)
class Decision:
  """One update's decision: the bound, what it did, and the smoothed ESS that
  decided it at `lag` (the first failing lag when tightening or holding at a
  failure; else the lowest measured one; 1.0 and lag -1 when none was)."""

  k: int
  action: str
  stat: float = 1.0
  lag: int = -1


def decide(k: int, averages: dict[int, float], streak: int,
           policy: StalenessPolicy, k_measured: bool = True) -> tuple[Decision, int]:
  """The rule's steps 2 and 3 (module docstring): the next K and streak.

  Args:
    k: the current (decided) bound.
    averages: smallest lag of each measured bucket -> its smoothed ESS.
    streak: updates in a row in which every measured lag passed, before this one.
    policy: the section's settings.
    k_measured: whether the bucket holding lag `k` itself was measured
      (a loosening waits for it: one probe at a time).

  Returns:
    The decision and the new streak.
  """
  failing = sorted(lo for lo, s in averages.items() if s < policy.ess_target)
  if failing:
    lag = failing[0]
    supported = max(policy.k_min, min(policy.k_max, lag - 1))
    if supported < k:
      return Decision(supported, "tighten", averages[lag], lag), 0
    # (a failure at or beyond K + 1 holds K; at k_min nothing tighter is allowed)
    return Decision(k, "hold", averages[lag], lag), 0
  lowest = min(averages, key=lambda lo: (averages[lo], lo), default=None)
  stat, lag = (1.0, -1) if lowest is None else (averages[lowest], lowest)
  if (k >= policy.k_max or stat < policy.ess_target + policy.loosen_margin
      or not k_measured):
    return Decision(k, "hold", stat, lag), 0
  streak += 1
  if streak >= policy.loosen_after:
    return Decision(k + 1, "loosen", stat, lag), 0
  return Decision(k, "hold", stat, lag), streak


class AdaptiveBound:
  """The staleness bound's state: the K in force, the K decided for the next
  publish, each lag's smoothed ESS and the loosening streak. Not
  thread-safe: the learner thread drives it through the orchestrator."""

  def __init__(self, policy: StalenessPolicy, initial_k: int):
    self._policy = policy
    self.k = initial_k  # decided; in force from the next publish
    self.applied_k = initial_k  # in force now
    self.applied_version = -1  # the publish that put it in force
    self._averages: dict[int, float] = {}
    self._streak = 0
    self.last = Decision(initial_k, "fixed" if not policy.adaptive else "hold")

  def observe(self, stats: list[LagStat]) -> Decision:
    """Takes one update's per-lag measurements; decides the next K (the rule
    of the module docstring). The fixed policy ignores them."""
    policy = self._policy
    if not policy.adaptive:
      return self.last
    averages, k_measured = {}, self.k < 1
    for s in stats:
      # Lag 0 is mismatch alone; a thin bucket's ESS is noise; a NaN (a
      # non-finite update) says nothing.
      if s.hi < 1 or s.tokens < policy.min_tokens or not math.isfinite(s.ess):
        continue
      old, ess = self._averages.get(s.lo), float(min(max(s.ess, 0.0), 1.0))
      averages[s.lo] = ess if old is None else (1 - policy.smoothing) * old + policy.smoothing * ess
      k_measured = k_measured or s.lo <= self.k <= s.hi
    self._averages = averages
    self.last, self._streak = decide(self.k, averages, self._streak, policy, k_measured)
    self.k = self.last.k
    return self.last

  def apply(self, version: int) -> int:
    """Puts the decided K in force for `version`, once per version (a resume
    publishes the version it restored again, and must keep its bound).
    Returns the K in force."""
    if version > self.applied_version:
      self.applied_k, self.applied_version = self.k, version
    return self.applied_k

  def metrics(self) -> dict:
    """`staleness_k` (in force), and under `adaptive` what set the next one:
    `staleness_k_next`, `staleness_k_action` (`ACTIONS`), `staleness_k_stat`
    (the smoothed ESS that decided) and `staleness_k_lag` (its lag; -1: none)."""
    out = {"staleness_k": self.applied_k, "staleness_k_action": ACTIONS[self.last.action]}
    if self._policy.adaptive:
      out.update(staleness_k_next=self.k, staleness_k_stat=float(self.last.stat),
                 staleness_k_lag=self.last.lag)
    return out

  def to_json(self) -> dict:
    """The whole state, for a checkpoint (a resume decides as the run would have)."""
    return {"policy": self._policy.policy, "k": self.k, "applied_k": self.applied_k,
            "applied_version": self.applied_version,
            "averages": {str(lo): s for lo, s in sorted(self._averages.items())},
            "streak": self._streak, "last": dataclasses.asdict(self.last)}

  def restore(self, record: dict) -> None:
    """Continues from a `to_json` record. The fixed policy keeps its
    configured K (it has no state of its own), a record of the fixed policy
    leaves the adaptive one at its start, and a K outside bounds changed since
    the save is brought inside them."""
    policy = self._policy
    if not policy.adaptive or record.get("policy") != policy.policy:
      return
    clamp = lambda k: min(max(int(k), policy.k_min), policy.k_max)
    self.k, self.applied_k = clamp(record["k"]), clamp(record["applied_k"])
    self.applied_version = int(record["applied_version"])
    self._averages = {int(lo): float(s) for lo, s in record["averages"].items()}
    self._streak = int(record["streak"])
    self.last = Decision(**record["last"])
