"""The soft overlong penalty: its values by hand, applied once as a group
reaches the orchestrator, before dynamic sampling sees the rewards."""

import numpy as np
import pytest

from arl_jax.core import rollout as rollout_lib
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.orchestrator import orchestrator_config, reward_shaping


@pytest.mark.parametrize("length,expected", [(10, 0.0), (12, 0.0), (13, -0.125), (16, -0.5),
                                             (20, -1.0)])
def test_penalty_by_hand(length, expected):
  # Budget 20, buffer 8: free up to 12 tokens, then -1/8 a token, -1 at 20.
  assert reward_shaping.penalty(length, 20, 8, 1.0) == pytest.approx(expected)
  assert reward_shaping.penalty(length, 20, 8, 0.5) == pytest.approx(expected / 2)
  assert reward_shaping.penalty(length, 20, 0, 1.0) == 0.0


class _Prompt:
  prompt_id = 0


def _group(group_id, lengths, rewards):
  return rollout_lib.Group(group_id=group_id, prompt_id=0, dispatch_version=0, rollouts=[
      rollout_lib.Rollout(group_id=group_id, sample_index=i, prompt_ids=np.array([1], np.int32),
                          completion_ids=np.full(n, 2, np.int32), loss_mask=np.ones(n, np.float32),
                          behaviour_logprobs=np.zeros(n, np.float32),
                          token_versions=np.zeros(n, np.int32), dispatch_version=0,
                          finish_reason="length" if n == 20 else "stop", reward=r,
                          env_name="sim")
      for i, (n, r) in enumerate(zip(lengths, rewards))])


def test_the_orchestrator_shapes_once_and_before_the_filter():
  orch = orchestrator_lib.Orchestrator(
      orchestrator_config.OrchestratorConfig(group_size=2, batch_size=2, filter_zero_variance=True,
                                         overlong_buffer=8, overlong_penalty=1.0),
      prompts=iter([_Prompt()] * 4), encode_fn=lambda p: [1], env_name_of=lambda p: "sim",
      max_new_tokens=20)
  orch.publish(0, trained=[])
  requests = orch.dispatcher.take(2, 0, timeout=0.0)
  # Both right, one long: the penalty makes their rewards differ, so it is kept.
  long_one = _group(requests[0].group_id, [10, 16], [1.0, 1.0])
  assert orch.group_finished(long_one)
  # A shaped copy: the rollouts the open work saves keep the environment's reward.
  assert [r.reward for r in long_one.rollouts] == [1.0, 1.0]
  # Both right and short: equal rewards, dropped.
  assert not orch.group_finished(_group(requests[1].group_id, [5, 12], [1.0, 1.0]))
  batch = orch.cut(0, timeout=1.0)
  np.testing.assert_allclose(batch.groups[0].rewards, [1.0, 0.5])
  assert orch.metrics()["dropped_zero_variance"] == 2


class _BudgetPrompt:
  def __init__(self, prompt_id, budget):
    self.prompt_id, self.budget = prompt_id, budget


def test_the_penalty_measures_against_the_prompt_s_own_budget():
  """An environment gives a prompt 12 tokens of the sampler's 20: a
  10-token completion is 2 tokens into that prompt's buffer of 8, and one
  that used all 12 gets the full penalty, as a 20-token one would at 20."""
  orch = orchestrator_lib.Orchestrator(
      orchestrator_config.OrchestratorConfig(group_size=2, batch_size=4, overlong_buffer=8,
                                         overlong_penalty=1.0),
      prompts=iter([_BudgetPrompt(0, 12), _BudgetPrompt(1, None)]),
      encode_fn=lambda p: [1], env_name_of=lambda p: "sim", max_new_tokens=20,
      budget_fn=lambda p: p.budget)
  orch.publish(0, trained=[])
  short_budget, full_budget = orch.dispatcher.take(2, 0, timeout=0.0)
  assert orch.group_finished(_group(short_budget.group_id, [10, 12], [1.0, 1.0]))
  assert orch.group_finished(_group(full_budget.group_id, [10, 12], [1.0, 1.0]))
  batch = orch.cut(0, timeout=1.0)
  rewards = {g.group_id: g.rewards for g in batch.groups}
  np.testing.assert_allclose(rewards[short_budget.group_id], [0.25, 0.0])
  np.testing.assert_allclose(rewards[full_budget.group_id], [1.0, 1.0])


def test_a_budget_below_the_buffer_is_penalised_over_its_whole_length():
  assert reward_shaping.penalty(0, 6, 8, 1.0) == 0.0
  assert reward_shaping.penalty(3, 6, 8, 1.0) == pytest.approx(-0.5)
  assert reward_shaping.penalty(6, 6, 8, 1.0) == pytest.approx(-1.0)
