"""Dynamic sampling: groups whose rewards do not differ are dropped as they
finish, counted under their own reason, replaced, and batches stay full
(whole runs replayed with the fake sampler and fake clock)."""

import collections
import dataclasses
import itertools

import numpy as np
import pytest

from arl_jax.core import rollout as rollout_lib
from arl_jax.orchestrator import orchestrator_config, zero_variance
from arl_jax.testing import fake_sampler

G = 4


@dataclasses.dataclass(frozen=True)
class Task:
  prompt_id: int


def _group(rewards, reasons=None):
  reasons = reasons or ["stop"] * len(rewards)
  return rollout_lib.Group(group_id=0, prompt_id=0, dispatch_version=0, rollouts=[
      rollout_lib.Rollout(group_id=0, sample_index=i, prompt_ids=np.array([1], np.int32),
                          completion_ids=np.array([2], np.int32),
                          loss_mask=np.ones(1, np.float32),
                          behaviour_logprobs=np.zeros(1, np.float32),
                          token_versions=np.zeros(1, np.int32), dispatch_version=0,
                          finish_reason=reason, reward=reward, env_name="sim")
      for i, (reward, reason) in enumerate(zip(rewards, reasons))])


def test_a_group_carries_signal_when_two_trainable_rewards_differ():
  assert zero_variance.carries_signal(_group([1.0, 0.0, 1.0, 1.0]), False)
  assert not zero_variance.carries_signal(_group([1.0] * 4), False)
  assert not zero_variance.carries_signal(_group([0.0] * 4), False)
  # Masked rollouts do not count: an errored 0 beside three 1s trains nothing.
  assert not zero_variance.carries_signal(_group([1.0, 1.0, 1.0, 0.0],
                                                 ["stop", "stop", "stop", "error"]), False)
  truncated = ["stop", "length", "length", "length"]
  assert zero_variance.carries_signal(_group([1.0, 0.0, 0.0, 0.0], truncated), False)
  assert not zero_variance.carries_signal(_group([1.0, 0.0, 0.0, 0.0], truncated), True)


def _simulate(filter_zero_variance, num_steps=30, requeue_dropped=0, max_async_level=1):
  # Two prompts in three are solved by every sample (equal rewards).
  def reward(task, sample):
    return 1.0 if task.prompt_id % 3 else float(sample % 2)
  rng = np.random.default_rng(0)
  cfg = fake_sampler.SimConfig(
      orchestrator=orchestrator_config.OrchestratorConfig(
          group_size=G, batch_size=4 * G, max_async_level=max_async_level,
          max_off_policy_steps=4, requeue_dropped=requeue_dropped,
          filter_zero_variance=filter_zero_variance),
      num_steps=num_steps, train_seconds=1.0, num_slots=64, reward_fn=reward)
  durations = rng.uniform(0.5, 3.0, 100_000)
  return fake_sampler.simulate(cfg, (Task(i) for i in itertools.count()),
                               lambda task: float(durations[task.prompt_id]))


def test_zero_variance_groups_are_dropped_counted_and_replaced_and_batches_stay_full():
  plain = _simulate(False)
  assert any(np.ptp(g.rewards) == 0 for c in plain.cuts for g in c.batch.groups)
  result = _simulate(True, requeue_dropped=2)
  orch = result.orchestrator
  metrics = orch.metrics()
  trained = [g for c in result.cuts for g in c.batch.groups]
  assert len(result.cuts) == 30 and all(len(c.batch.groups) == 4 for c in result.cuts)
  assert all(np.ptp(g.rewards) > 0 for g in trained)
  # Every group that finished is either trained, in the buffer, or counted here.
  dropped_groups = metrics["dropped_zero_variance"] // G
  assert dropped_groups > 0 and metrics["drops_by_env"]["sim"]["zero_variance"] == G * (
      dropped_groups)
  finished = dropped_groups + len(trained) + len(orch.buffer)
  assert 0.3 < metrics["zero_variance_kept_fraction"] < 0.4  # one prompt in three
  np.testing.assert_allclose(metrics["zero_variance_kept_fraction"],
                             (finished - dropped_groups) / finished)
  # Never requeued: each prompt was dispatched once.
  prompts = collections.Counter(d.prompt_id for d in result.dispatches)
  assert max(prompts.values()) == 1 and metrics["requeued_groups"] == 0
  # Admission counted a group in flight as the kept share (about a third),
  # so more groups were generated ...
  assert 1 / zero_variance.MAX_SCALE <= metrics["admission_yield"] < 0.6
  assert len(result.dispatches) > 2 * len(plain.dispatches)
  # ... while the groups that will ship stayed about what admission intends:
  # the lag grows by less than a version (1.0 -> 1.5 here: the kept share of
  # the many in flight varies), and nothing went stale.
  lags = [c.batch.lag_metrics()["lag_mean"] for c in result.cuts[5:]]
  plain_lags = [c.batch.lag_metrics()["lag_mean"] for c in plain.cuts[5:]]
  assert np.mean(lags) < np.mean(plain_lags) + 1.0
  assert metrics["dropped_stale"] == metrics["dropped_cancelled"] == 0


def test_the_counts_survive_a_checkpoint():
  orch = _simulate(True, num_steps=6).orchestrator
  fresh = _simulate(True, num_steps=1).orchestrator
  # (`Orchestrator.snapshot` holds these two records beside the open work.)
  fresh.ledger.restore(orch.ledger.to_json())
  fresh.kept.restore(orch.kept.to_json())
  assert fresh.kept.to_json() == orch.kept.to_json()
  for key in ("dropped_zero_variance", "zero_variance_kept_fraction", "drops_by_env"):
    assert fresh.metrics()[key] == orch.metrics()[key]


@pytest.mark.parametrize("recent,share", [([], 1.0), ([True] * 4, 1.0),
                                          ([True, False, False, False], 0.25),
                                          ([True, False], 0.5), ([False] * 8, 0.25)])
def test_expected_yield_follows_the_recent_kept_fraction(recent, share):
  kept = zero_variance.KeptFraction(window=8)
  for k in recent:
    kept.add(k)
  assert kept.expected_yield() == share
