"""The adaptive staleness bound (`orchestrator/adaptive_staleness.py`): the rule
alone under a synthetic off-policy drift and its recovery, its checkpoint, and
whole runs replayed with the fake sampler where it tightens and admission
paces itself."""

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from arl_jax.core import settings
from arl_jax.orchestrator import adaptive_staleness as adaptive
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.orchestrator import orchestrator_config
from arl_jax.testing import fake_sampler

# `learner/update.LAG_BUCKETS` (not imported: the orchestrator's tests stay
# free of JAX); tests/learner/update_test.py checks the learner loop reads these.
BUCKETS = (*((lag, lag) for lag in range(9)), (9, 1 << 30))


def stats_of(ess_fn, k=None, tokens=1000.0):
  """One update's measurements: bucket `[lo, hi]` has ESS `ess_fn(lo)`; lags
  beyond `k` are not measured (nothing that old trained)."""
  return [adaptive.LagStat(lo, hi, ess_fn(lo), tokens if k is None or lo <= k else 0.0)
          for lo, hi in BUCKETS]


def drift_ess(strength):
  """The ESS of lag `l` under a policy that moves `strength` per version:
  log-normal ratios whose log-variance grows with the lag, `exp(-s l^2)`."""
  return lambda lag: math.exp(-strength * lag * lag)


POLICY = adaptive.StalenessPolicy(policy="adaptive", k_min=1, k_max=8, ess_target=0.9,
                                  smoothing=0.5, loosen_after=2, min_tokens=64)


def run_bound(bound, strengths, ess_fn=None):
  """Feeds one update per drift strength (only lags <= the K in force are
  measured; `ess_fn`: the ESS by lag instead of a drift) and publishes after
  each; returns the K in force after each."""
  ks = []
  for version, strength in enumerate(strengths, start=1):
    bound.observe(stats_of(ess_fn or drift_ess(strength), k=bound.applied_k))
    ks.append(bound.apply(version))
  return ks


def test_the_bound_tightens_under_drift_and_loosens_one_lag_at_a_time_on_recovery():
  bound = adaptive.AdaptiveBound(POLICY, initial_k=8)
  bound.apply(0)
  calm, drift, recovery = [0.0] * 5, list(np.linspace(0.0, 0.2, 12)), [0.0] * 20
  ks = run_bound(bound, calm + drift + recovery)
  assert all(POLICY.k_min <= k <= POLICY.k_max for k in ks)
  assert ks[:5] == [8] * 5  # on-policy enough: nothing fails, K stays at k_max
  during, after = ks[5:17], ks[17:]
  # Down as the drift grows: the larger lags collapse first (exp(-s l^2)), and
  # at s = 0.2 even lag 1 fails (0.82 < 0.9), so K ends at k_min and holds.
  # (On the way it may probe one lag up after `loosen_after` updates of
  # passing lags, and come straight back.)
  assert during[0] == 8 and during[-1] == POLICY.k_min
  assert max(during[6:]) <= 2 and np.mean(during[6:]) < np.mean(during[:6])
  steps = np.diff([during[-1], *after])
  assert set(steps) <= {0, 1}  # loosens by at most one lag per update
  assert after[-1] == POLICY.k_max  # and comes back to k_max
  # at most one loosening per `loosen_after` updates
  rises = [i for i, s in enumerate(steps) if s == 1]
  assert len(rises) == POLICY.k_max - POLICY.k_min
  assert all(b - a >= POLICY.loosen_after for a, b in zip(rises, rises[1:]))


def test_tightening_goes_to_the_lag_below_the_first_failing_one_at_once():
  bound = adaptive.AdaptiveBound(dataclasses.replace(POLICY, smoothing=1.0), initial_k=8)
  decision = bound.observe(stats_of(lambda lag: 0.95 if lag < 3 else 0.5))
  assert (decision.k, decision.action, decision.lag, decision.stat) == (2, "tighten", 3, 0.5)
  assert bound.metrics()["staleness_k_action"] == adaptive.ACTIONS["tighten"]


def test_the_smoothed_ess_decides_and_a_single_bad_update_is_damped():
  bound = adaptive.AdaptiveBound(dataclasses.replace(POLICY, smoothing=0.25), initial_k=8)
  bound.observe(stats_of(lambda lag: 1.0))
  # 0.75 * 1.0 + 0.25 * 0.7 = 0.925 >= 0.9: holds
  assert bound.observe(stats_of(lambda lag: 1.0 if lag < 2 else 0.7)).k == 8
  # 0.75 * 0.925 + 0.25 * 0.7 = 0.869 < 0.9: lag 2 fails
  decision = bound.observe(stats_of(lambda lag: 1.0 if lag < 2 else 0.7))
  assert (decision.k, decision.lag) == (1, 2)
  assert decision.stat == pytest.approx(0.86875)


def test_lag_zero_thin_buckets_and_unmeasured_lags_do_not_decide():
  bound = adaptive.AdaptiveBound(dataclasses.replace(POLICY, k_max=4), initial_k=2)
  # lag 0 (mismatch alone) fails, lag 3_4 fails on 10 tokens, lags >= 5 unknown
  stats = [adaptive.LagStat(0, 0, 0.1, 1000.0), adaptive.LagStat(1, 1, 0.99, 1000.0),
           adaptive.LagStat(2, 2, 0.99, 1000.0), adaptive.LagStat(3, 4, 0.1, 10.0),
           adaptive.LagStat(5, 8, 1.0, 0.0), adaptive.LagStat(9, 1 << 30, float("nan"), 500.0)]
  ks = [bound.observe(stats).k for _ in range(6)]
  # Probes one lag past what was measured (3), and no further until lag 3's
  # bucket is measured (here it stays thin).
  assert ks == [2, 3, 3, 3, 3, 3]


def test_a_lag_that_only_just_passes_holds_k_instead_of_probing_a_failing_one():
  """Hysteresis (`loosen_margin`): lags up to 4 pass by less than the margin
  and lag 5 fails. With the margin the bound settles at 4; without it, it
  probes 5 every `loosen_after` updates and is taken straight back (each
  time dropping what was sampled for lag 5)."""
  ess = lambda lag: 0.91 if lag <= 4 else 0.85

  def ks(margin):
    bound = adaptive.AdaptiveBound(dataclasses.replace(POLICY, smoothing=1.0,
                                                       loosen_margin=margin), initial_k=4)
    return run_bound(bound, [None] * 12, ess_fn=ess)

  assert ks(0.03) == [4] * 12
  sawing = ks(0.0)
  assert sawing.count(5) >= 3 and sawing[-4:] != [4] * 4


def test_a_loosening_waits_for_the_last_probe_to_be_measured():
  """While the pipeline's lag fills (lags beyond 2 not yet trained), K probes
  lag 3 and waits there: it does not climb to k_max on lags it never
  measured, to fall back when they are (dropping what was sampled for them)."""
  bound = adaptive.AdaptiveBound(dataclasses.replace(POLICY, smoothing=1.0), initial_k=2)
  filling = [bound.observe(stats_of(lambda lag: 0.99, k=2)).k for _ in range(8)]
  assert filling == [2, 3, 3, 3, 3, 3, 3, 3]
  measured = [bound.observe(stats_of(lambda lag: 0.99, k=3)).k for _ in range(3)]
  assert measured == [3, 4, 4]


def test_the_bound_holds_at_k_min_when_even_lag_one_fails():
  bound = adaptive.AdaptiveBound(dataclasses.replace(POLICY, k_min=2), initial_k=4)
  decision = bound.observe(stats_of(lambda lag: 0.1))
  assert (decision.k, decision.action) == (2, "tighten")
  assert bound.observe(stats_of(lambda lag: 0.1)).action == "hold"
  assert bound.k == 2


def test_a_decision_comes_into_force_at_the_next_publish_once():
  bound = adaptive.AdaptiveBound(dataclasses.replace(POLICY, smoothing=1.0), initial_k=8)
  assert bound.apply(0) == 8
  bound.observe(stats_of(lambda lag: 0.5))  # decides 1
  assert (bound.k, bound.applied_k) == (1, 8)
  assert bound.apply(0) == 8  # a resume publishing version 0 again keeps it
  assert bound.apply(1) == 1
  assert bound.metrics() == {"staleness_k": 1, "staleness_k_next": 1,
                             "staleness_k_action": adaptive.ACTIONS["tighten"],
                             "staleness_k_stat": 0.5, "staleness_k_lag": 1}


def test_the_fixed_policy_ignores_measurements():
  bound = adaptive.AdaptiveBound(adaptive.StalenessPolicy(), initial_k=3)
  for version in range(5):
    bound.observe(stats_of(lambda lag: 0.01))
    assert bound.apply(version) == 3
  assert bound.metrics() == {"staleness_k": 3, "staleness_k_action": 0}
  # A fixed run keeps its configured K whatever a checkpoint says.
  bound.restore({**bound.to_json(), "k": 7, "applied_k": 7})
  assert bound.applied_k == 3


def test_save_restore_continue_gives_the_k_sequence_of_an_uninterrupted_run():
  strengths = [0.0] * 3 + list(np.linspace(0, 0.2, 8)) + [0.0] * 8 + [0.05] * 6
  whole = adaptive.AdaptiveBound(POLICY, initial_k=6)
  whole.apply(0)
  expected = run_bound(whole, strengths)
  for cut in (4, 9, 14, 20):
    first = adaptive.AdaptiveBound(POLICY, initial_k=6)
    first.apply(0)
    ks = run_bound(first, strengths[:cut])
    saved = json.loads(json.dumps(first.to_json()))
    resumed = adaptive.AdaptiveBound(POLICY, initial_k=6)
    resumed.restore(saved)
    assert resumed.apply(cut) == ks[-1]  # (the resume publishes its version again)
    for version, strength in enumerate(strengths[cut:], start=cut + 1):
      resumed.observe(stats_of(drift_ess(strength), k=resumed.applied_k))
      ks.append(resumed.apply(version))
    assert ks == expected, cut
    assert resumed.to_json() == whole.to_json()


def test_a_restore_under_changed_bounds_or_policy():
  bound = adaptive.AdaptiveBound(dataclasses.replace(POLICY, smoothing=1.0), initial_k=8)
  bound.observe(stats_of(lambda lag: 1.0))
  saved = bound.to_json()
  narrower = adaptive.AdaptiveBound(dataclasses.replace(POLICY, k_max=4), initial_k=4)
  narrower.restore(saved)
  assert (narrower.k, narrower.applied_k) == (4, 4)
  fixed_record = adaptive.AdaptiveBound(adaptive.StalenessPolicy(), initial_k=2).to_json()
  fresh = adaptive.AdaptiveBound(POLICY, initial_k=5)
  fresh.restore(fixed_record)
  assert (fresh.k, fresh.applied_k, fresh.applied_version) == (5, 5, -1)


@pytest.mark.parametrize("kwargs, key", [
    (dict(policy="dynamic"), "policy"), (dict(k_min=-1), "k_min"),
    (dict(k_min=3, k_max=2), "k_max"), (dict(ess_target=1.0), "ess_target"),
    (dict(smoothing=0.0), "smoothing"), (dict(loosen_after=0), "loosen_after"),
    (dict(loosen_margin=0.1), "loosen_margin"),
    (dict(min_tokens=0), "min_tokens"), (dict(pace_admissions=1), "pace_admissions")])
def test_bad_settings_name_their_key(kwargs, key):
  with pytest.raises(settings.SettingError) as e:
    adaptive.StalenessPolicy(**kwargs)
  assert e.value.key == key


def test_the_starting_k_must_lie_in_the_adaptive_bounds():
  with pytest.raises(settings.SettingError, match=r"max_off_policy_steps: 8: under "
                     r"staleness.policy='adaptive' .* \[1, 4\]"):
    orchestrator_config.OrchestratorConfig(
        batch_size=4, group_size=2, max_off_policy_steps=8,
        staleness=adaptive.StalenessPolicy(policy="adaptive", k_max=4))
  # (the fixed policy reads no bounds)
  orchestrator_config.OrchestratorConfig(
      batch_size=4, group_size=2, max_off_policy_steps=8,
      staleness=adaptive.StalenessPolicy(k_max=4))


# -- whole runs, replayed with the fake sampler --------------------------------


@dataclasses.dataclass(frozen=True)
class Task:
  prompt_id: int
  seconds: float


def tasks(seed=0):
  rng = np.random.default_rng(seed)
  for i in itertools.count():
    yield Task(i, float(rng.uniform(0.5, 4.0)))


def sim_lag_stats(drift_from, strength=0.3):
  """Measures a simulated batch as the learner would: each bucket's tokens by
  their lag; the policy drifts from version `drift_from` on, so every lag's
  ESS is then `exp(-strength l^2)` (at 0.3 even lag 1 fails 0.9)."""
  def lag_stats(batch):
    lags = np.concatenate([batch.batch_version - r.token_versions
                           for g in batch.groups for r in g.rollouts])
    s = strength if batch.batch_version >= drift_from else 0.0
    return [adaptive.LagStat(lo, hi, math.exp(-s * lo * lo),
                             float(np.sum((lags >= lo) & (lags <= hi))))
            for lo, hi in BUCKETS]
  return lag_stats


def sim(policy, drift_from=10, num_steps=40, k=4, max_async_level=4):
  cfg = fake_sampler.SimConfig(
      orchestrator=orchestrator_config.OrchestratorConfig(
          group_size=2, batch_size=8, max_async_level=max_async_level, max_off_policy_steps=k,
          staleness=policy),
      num_steps=num_steps, train_seconds=1.0, num_slots=8,
      lag_stats_fn=sim_lag_stats(drift_from))
  return fake_sampler.simulate(cfg, tasks(), lambda task: task.seconds)


SIM_POLICY = adaptive.StalenessPolicy(policy="adaptive", k_min=1, k_max=4, ess_target=0.9,
                                      smoothing=1.0, loosen_after=2, min_tokens=1)


def born_to_be_dropped(result):
  """Groups dropped as stale or cancelled (the ledger counts rollouts, 2 a group)."""
  ledger = result.orchestrator.ledger.dropped
  return (ledger["stale"] + ledger["cancelled"]) // 2


def test_a_replayed_run_tightens_k_under_drift_and_every_batch_respects_the_k_in_force():
  result = sim(SIM_POLICY)
  bound = result.orchestrator.bound
  assert bound.applied_k == SIM_POLICY.k_min  # the drift collapsed every lag past 1
  for cut in result.cuts:
    assert cut.batch.lag_metrics()["lag_max"] <= 4
  late = [c for c in result.cuts if c.batch.batch_version >= 14]  # two publishes later
  assert late and all(c.batch.lag_metrics()["lag_max"] <= SIM_POLICY.k_min for c in late)
  metrics = result.orchestrator.metrics()
  assert metrics["staleness_k"] == SIM_POLICY.k_min
  # held there by lag 1's ESS, below the target
  assert (metrics["staleness_k_lag"], metrics["staleness_k_action"]) == (1, 1)
  assert metrics["staleness_k_stat"] == pytest.approx(math.exp(-0.3))


def test_pacing_starts_fewer_groups_that_are_born_to_be_dropped():
  paced = sim(SIM_POLICY)
  unpaced = sim(dataclasses.replace(SIM_POLICY, pace_admissions=False))
  # Same bound, same trained batches' lags allowed ...
  assert paced.orchestrator.bound.applied_k == unpaced.orchestrator.bound.applied_k == 1
  # ... but without pacing admission keeps max_async_level + 1 = 5 batches in
  # the system, and most of what it starts past K + 1 = 2 is dropped.
  assert born_to_be_dropped(paced) < born_to_be_dropped(unpaced) / 2
  assert len(paced.dispatches) < len(unpaced.dispatches)
  assert max(d.dispatch_version for d in paced.dispatches) >= 39  # still trains on


def test_the_fixed_policy_replays_as_before_whatever_the_learner_measures():
  fixed = adaptive.StalenessPolicy(k_min=1, k_max=4)
  measured = sim(fixed)
  unmeasured_cfg = fake_sampler.SimConfig(
      orchestrator=orchestrator_config.OrchestratorConfig(
          group_size=2, batch_size=8, max_async_level=4, max_off_policy_steps=4),
      num_steps=40, train_seconds=1.0, num_slots=8)
  unmeasured = fake_sampler.simulate(unmeasured_cfg, tasks(), lambda task: task.seconds)
  assert measured.dispatches == unmeasured.dispatches
  assert measured.events == unmeasured.events
  trained = lambda result: [[g.group_id for g in c.batch.groups] for c in result.cuts]
  assert trained(measured) == trained(unmeasured)
  assert measured.orchestrator.ledger.metrics() == unmeasured.orchestrator.ledger.metrics()
  assert measured.orchestrator.bound.applied_k == 4


def test_the_orchestrator_checkpoint_carries_the_bound():
  cfg = orchestrator_config.OrchestratorConfig(
      group_size=2, batch_size=8, max_async_level=4, max_off_policy_steps=4,
      staleness=dataclasses.replace(SIM_POLICY, smoothing=0.5))

  def fresh():
    return orchestrator_lib.Orchestrator(cfg, prompts=iter(()), encode_fn=lambda p: [1],
                                         env_name_of=lambda p: "sim", max_new_tokens=8)
  orch = fresh()
  for version, ess in enumerate([1.0, 0.8, 0.8, 1.0]):
    orch.publish(version, trained=[])
    orch.observe_update(stats_of(lambda lag, ess=ess: ess if lag > 1 else 1.0))
  assert orch.dispatcher.bound == orch.buffer._k == 1
  assert orch.dispatcher.free_capacity() == 2 * cfg.groups_per_batch  # paced: K + 1 batches
  saved = orch.snapshot({})
  saved["staleness"] = json.loads(json.dumps(saved["staleness"]))  # (as a checkpoint holds it)
  resumed = fresh()
  resumed.restore(saved)
  assert resumed.bound.to_json() == orch.bound.to_json()
  assert resumed.dispatcher.bound == resumed.buffer._k == 1
  resumed.publish(3, trained=[])  # (a resume publishes its version again)
  assert resumed.metrics()["staleness_k"] == orch.metrics()["staleness_k"] == 1
  for o in (orch, resumed):
    o.observe_update(stats_of(lambda lag: 1.0))
    o.publish(4, trained=[])
  assert resumed.bound.to_json() == orch.bound.to_json()
