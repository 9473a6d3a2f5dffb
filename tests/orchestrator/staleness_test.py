"""The staleness rule, including the seed document's worked example."""

import numpy as np
import pytest

from arl_jax.core import rollout as rollout_lib
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import orchestrator_config, staleness


def make_group(group_id, dispatch_version, token_versions_per_rollout):
  rollouts = []
  for s, versions in enumerate(token_versions_per_rollout):
    n = len(versions)
    rollouts.append(rollout_lib.Rollout(
        group_id=group_id, sample_index=s, prompt_ids=np.array([1, 2], np.int32),
        completion_ids=np.arange(n, dtype=np.int32), loss_mask=np.ones(n, np.float32),
        behaviour_logprobs=np.full(n, -1.0, np.float32),
        token_versions=np.asarray(versions, np.int32), dispatch_version=dispatch_version,
        finish_reason="stop", reward=float(s)))
  return rollout_lib.Group(group_id=group_id, prompt_id=group_id,
                           dispatch_version=dispatch_version, rollouts=rollouts)


def _cut(buffer, groups, batch_version, num_groups):
  for g in groups:
    buffer.register_dispatch(g.group_id, g.dispatch_version)
  for g in groups:
    buffer.put(g, live_version=batch_version)
  return buffer.try_cut(batch_version, num_groups)


# The coding rollout: 3,000 tokens under pi_9, 4,500 under pi_10, the rest
# under pi_11 (scaled down 100x), dispatched while inference served pi_9.
CODING_VERSIONS = [9] * 30 + [10] * 45 + [11] * 20


@pytest.mark.parametrize("reference", ["dispatch", "oldest_token"])
def test_seed_worked_example_k2_drops_the_coding_rollout(reference):
  coding = make_group(0, 9, [CODING_VERSIONS, CODING_VERSIONS])
  assert coding.rollouts[0].version_span == (9, 11)
  buffer = buffer_lib.RolloutBuffer(orchestrator_config.OrchestratorConfig(
      batch_size=2, group_size=2, max_off_policy_steps=2, staleness_reference=reference,
      assembly="first_done"))
  fresh = make_group(1, 11, [[11, 11], [11, 11]])
  # It finishes while the trainer collects B_12: lag 12 - 9 = 3 > K = 2.
  result = _cut(buffer, [coding, fresh], batch_version=12, num_groups=1)
  assert [g.group_id for g in result.stale] == [0]
  assert [g.group_id for g in result.groups] == [1]


def test_seed_worked_example_k4_trains_the_coding_rollout():
  coding = make_group(0, 9, [CODING_VERSIONS, CODING_VERSIONS])
  buffer = buffer_lib.RolloutBuffer(orchestrator_config.OrchestratorConfig(batch_size=2, group_size=2,
                                                                        max_off_policy_steps=4))
  result = _cut(buffer, [coding], batch_version=12, num_groups=1)
  assert result.stale == []
  assert [g.group_id for g in result.groups] == [0]
  # ... each token keeping the version (and so the probability) it was sampled with.
  np.testing.assert_array_equal(result.groups[0].rollouts[0].token_versions, CODING_VERSIONS)


def test_seed_worked_example_math_rollout_has_lag_one():
  math_group = make_group(0, 9, [[9] * 5, [9] * 7])
  assert staleness.lag(10, math_group, "dispatch") == 1
  assert not staleness.is_stale(10, math_group, 2, "dispatch")


def test_prime_rl_example_last_trained_in_b18_dropped_from_b19():
  """Dispatched at 10, K=8: trains in the batch updating 18 -> 19, not in B_19."""
  group = make_group(0, 10, [[10, 11], [10, 12]])
  assert not staleness.is_stale(18, group, 8, "dispatch")
  assert staleness.is_stale(19, group, 8, "dispatch")


def test_oldest_token_reference_is_less_conservative_than_dispatch():
  # Re-admitted work can start after its dispatch version; the references differ.
  group = make_group(0, 5, [[7, 8], [7, 7]])
  assert staleness.lag(10, group, "dispatch") == 5
  assert staleness.lag(10, group, "oldest_token") == 3
  assert staleness.is_stale(10, group, 4, "dispatch")
  assert not staleness.is_stale(10, group, 4, "oldest_token")


def test_time_waiting_in_the_buffer_counts():
  group = make_group(0, 3, [[3], [3]])
  buffer = buffer_lib.RolloutBuffer(orchestrator_config.OrchestratorConfig(batch_size=2, group_size=2,
                                                                        max_off_policy_steps=2))
  buffer.register_dispatch(0, 3)
  buffer.put(group, live_version=4)
  # Not cut at B_4 (a batch of 2 groups was wanted), still waiting at B_6.
  assert buffer.try_cut(4, 2).groups is None
  result = buffer.try_cut(6, 2)
  assert [g.group_id for g in result.stale] == [0]


def test_can_still_ship():
  assert staleness.can_still_ship(10, live_version=18, max_off_policy_steps=8)
  assert not staleness.can_still_ship(10, live_version=19, max_off_policy_steps=8)
  # Nothing sampled yet under oldest_token: its tokens will be new enough.
  assert staleness.can_still_ship(None, live_version=100, max_off_policy_steps=0)


def test_in_flight_reference():
  assert staleness.in_flight_reference(3, 5, "dispatch") == 3
  assert staleness.in_flight_reference(3, 5, "oldest_token") == 5
  assert staleness.in_flight_reference(3, None, "oldest_token") is None


def test_rollout_rejects_sampled_token_without_version():
  with pytest.raises(ValueError, match="no version"):
    make_group(0, 1, [[1, -1]])
