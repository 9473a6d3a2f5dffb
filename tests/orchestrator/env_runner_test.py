"""Environment faults are counted and survived; errored rollouts never train."""

import time

import numpy as np
import pytest

from arl_jax import train_batch as train_batch_lib
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import env_runner as env_runner_lib
from tests.orchestrator.staleness_test import make_group


class _Prompt:
  prompt_id = 7


class FlakyEnv:
  """Raises on the completion whose first token is 99."""

  name = "flaky"

  def score(self, prompt, completion_ids):
    if completion_ids[0] == 99:
      raise RuntimeError("tool crashed")
    return 1.0 if completion_ids[0] == 1 else 0.0


def test_env_exception_marks_the_rollout_error_and_the_group_still_arrives():
  buffer = buffer_lib.RolloutBuffer(buffer_lib.BufferConfig())
  buffer.register_dispatch(0, 0)
  runner = env_runner_lib.EnvRunner(FlakyEnv(), buffer, num_workers=2)
  group = make_group(0, 0, [[0, 0], [0, 0], [0, 0]])
  for r, first in zip(group.rollouts, (1, 99, 2)):
    r.completion_ids = np.array([first, 5], np.int32)
    r.reward = None
  request = dispatcher_lib.GroupRequest(group_id=0, prompt=_Prompt(), prompt_ids=(1, 2),
                                        dispatch_version=0, group_size=3,
                                        dispatch_time=time.monotonic())
  runner.submit(request, group.rollouts)
  result = buffer.cut(0, 1, timeout=5)
  runner.close()
  scored = result.groups[0].rollouts
  assert [r.finish_reason for r in scored] == ["stop", "error", "stop"]
  assert [r.reward for r in scored] == [1.0, 0.0, 0.0]
  assert runner.errors == {"flaky": 1}
  assert all("in_env" in r.timings and r.env_name == "flaky" for r in scored)

  batch = train_batch_lib.assemble(result.groups, batch_version=0, prompt_len=4,
                                   max_new_tokens=3, pad_id=256, advantage_estimator="grpo",
                                   staleness_reference="dispatch")
  assert batch.loss_mask[1].sum() == 0  # the errored rollout is not trained on
  assert batch.loss_mask[0].sum() == 2 and batch.loss_mask[2].sum() == 2


def test_assemble_lays_out_rows_like_the_sampler():
  group = make_group(3, 5, [[5, 6], [6]])
  batch = train_batch_lib.assemble([group], batch_version=7, prompt_len=4, max_new_tokens=3,
                                   pad_id=256, advantage_estimator="grpo",
                                   staleness_reference="dispatch")
  np.testing.assert_array_equal(batch.tokens[0], [256, 256, 1, 2, 0, 1, 256])
  np.testing.assert_array_equal(batch.token_mask[1], [0, 0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(batch.token_versions[0], [-1, -1, -1, -1, 5, 6, -1])
  np.testing.assert_array_equal(batch.lag, [2, 2])
  np.testing.assert_allclose(batch.advantages, [-1, 1], atol=1e-5)  # rewards 0 and 1


def test_a_worker_bug_is_surfaced_not_swallowed():
  buffer = buffer_lib.RolloutBuffer(buffer_lib.BufferConfig())
  buffer.register_dispatch(0, 0)
  runner = env_runner_lib.EnvRunner(FlakyEnv(), buffer, num_workers=1)
  group = make_group(0, 0, [[0], [0]])
  request = dispatcher_lib.GroupRequest(group_id=0, prompt=object(),  # no prompt_id
                                        prompt_ids=(1,), dispatch_version=0, group_size=2,
                                        dispatch_time=time.monotonic())
  runner.submit(request, group.rollouts)
  runner.close()
  with pytest.raises(RuntimeError, match="environment worker failed"):
    runner.raise_if_failed()
