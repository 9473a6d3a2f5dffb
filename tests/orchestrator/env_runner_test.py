"""Environment faults are counted and survived; multi-turn episodes go back to the engine."""

import threading
import time

import numpy as np
import pytest

from arl_jax.core import episode as episode_lib
from arl_jax.core import group_request as group_request_lib
from arl_jax.core import train_batch as train_batch_lib
from arl_jax.envs import env_api
from arl_jax.orchestrator import env_runner as env_runner_lib
from tests.orchestrator.staleness_test import make_group

EOS, CALL_END = 258, 93  # 93 is "]"


class _Prompt:
  prompt_id = 7


def _request(group_id=0, group_size=3, prompt=None):
  return group_request_lib.GroupRequest(group_id=group_id, prompt=prompt or _Prompt(),
                                     prompt_ids=(1, 2), dispatch_version=0,
                                     group_size=group_size, dispatch_time=time.monotonic())


def _episode(request, index, tokens, stopped=True, version=0):
  episode = episode_lib.Episode(request=request, sample_index=index)
  episode.add_segment(tokens, [-0.5] * len(tokens), [version] * len(tokens), stopped=stopped)
  return episode


class FlakyEnv(env_api.Environment):
  """Raises on the completion whose first token is 99; sleeps on 77."""

  name = "flaky"

  def encode_prompt(self, prompt):
    return [1, 2]

  def score(self, prompt, completion_ids):
    if completion_ids[0] == 99:
      raise RuntimeError("tool crashed")
    if completion_ids[0] == 77:
      time.sleep(2.0)
    return 1.0 if completion_ids[0] == 1 else 0.0


class Collector:
  def __init__(self):
    self.groups = []
    self.arrived = threading.Event()

  def __call__(self, group):
    self.groups.append(group)
    self.arrived.set()


def test_env_exception_and_timeout_mark_the_rollout_error_and_the_group_still_arrives():
  collector = Collector()
  runner = env_runner_lib.EnvRunner(FlakyEnv(), on_group_fn=collector, max_new_tokens=8,
                                    num_workers=4, timeout_s=0.3)
  request = _request(group_size=4)
  start = time.monotonic()
  for index, first in enumerate((1, 99, 2, 77)):
    runner.submit(_episode(request, index, [first, 5, EOS]))
  assert collector.arrived.wait(5)
  assert time.monotonic() - start < 1.5  # the slow call was abandoned at its timeout
  runner.close()
  (group,) = collector.groups
  assert [r.finish_reason for r in group.rollouts] == ["stop", "error", "stop", "error"]
  assert [r.reward for r in group.rollouts] == [1.0, 0.0, 0.0, 0.0]
  assert runner.errors == {"flaky": 2} and runner.timeouts == {"flaky": 1}
  assert all(r.env_name == "flaky" for r in group.rollouts)
  assert group.rollouts[3].timings["in_env"] >= 0.3

  batch = train_batch_lib.assemble([group], prompt_len=4, max_new_tokens=3, pad_id=256,
                                   advantage_estimator="grpo")
  assert batch.loss_mask[1].sum() == 0 and batch.loss_mask[3].sum() == 0  # never trained on
  assert batch.loss_mask[0].sum() == 3 and batch.loss_mask[2].sum() == 3


class CalculatorEnv(env_api.MultiTurnEnvironment):
  """Answers `[...]` tool calls with `=42;`; the episode ends at EOS."""

  name = "calc"
  stop_ids = (CALL_END,)

  def __init__(self):
    self.calls = []

  def encode_prompt(self, prompt):
    return [1, 2]

  def step(self, prompt, completion_ids):
    self.calls.append(list(completion_ids))
    if completion_ids[-1] == CALL_END:
      return list(b"=42;")
    return None

  def score(self, prompt, completion_ids):
    return float(bytes(t for t in completion_ids if t < 256).endswith(b";42"))


def test_multi_turn_observations_are_appended_unmasked_and_the_episode_resumes():
  collector, resumed = Collector(), []
  env = CalculatorEnv()
  runner = env_runner_lib.EnvRunner(env, on_group_fn=collector, max_new_tokens=16,
                                    num_workers=2, timeout_s=1.0)
  runner.connect(resumed.append)
  request = _request(group_size=2)
  first, second = _episode(request, 0, [91, 55, CALL_END]), _episode(request, 1, [52, EOS])
  runner.submit(first)
  runner.submit(second)
  deadline = time.monotonic() + 5
  while not resumed and time.monotonic() < deadline:
    time.sleep(0.01)
  assert resumed == [first]
  np.testing.assert_array_equal(first.completion_ids, [91, 55, CALL_END, *b"=42;"])
  np.testing.assert_array_equal(first.loss_mask, [1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(first.versions, [0, 0, 0, -1, -1, -1, -1])
  # The engine would sample the answer under a newer version; emulate it.
  first.add_segment([*b"42", EOS], [-0.1] * 3, [2] * 3, stopped=True)
  runner.submit(first)
  assert collector.arrived.wait(5)
  runner.close()
  (group,) = collector.groups
  rollout = group.rollouts[0]
  assert rollout.finish_reason == "stop" and rollout.reward == 1.0
  assert rollout.version_span == (0, 2)
  assert group.rollouts[1].reward == 0.0
  assert runner.turns == 1 and not runner.errors


def test_an_observation_that_does_not_fit_ends_the_episode_as_length():
  collector = Collector()
  runner = env_runner_lib.EnvRunner(CalculatorEnv(), on_group_fn=collector, max_new_tokens=6,
                                    num_workers=1)
  runner.connect(lambda episode: pytest.fail("must not resume"))
  request = _request(group_size=1)
  runner.submit(_episode(request, 0, [91, CALL_END]))  # 2 + 4 observation tokens leave no room
  assert collector.arrived.wait(5)
  runner.close()
  assert collector.groups[0].rollouts[0].finish_reason == "length"


def test_cancelled_groups_are_dropped_when_their_episodes_come_back():
  collector = Collector()
  runner = env_runner_lib.EnvRunner(FlakyEnv(), on_group_fn=collector, max_new_tokens=8)
  request = _request(group_size=2)
  runner.submit(_episode(request, 0, [1, EOS]))
  runner.cancel([0])
  runner.submit(_episode(request, 1, [1, EOS]))
  runner.close()
  assert not collector.groups


class MalformedEnv(CalculatorEnv):
  """Answers with a non-token observation, and scores with a non-number."""

  name = "malformed"

  def step(self, prompt, completion_ids):
    return ["=", "4"] if completion_ids[-1] == CALL_END else None

  def score(self, prompt, completion_ids):
    return None


def test_malformed_answers_are_environment_faults_not_crashes():
  collector = Collector()
  runner = env_runner_lib.EnvRunner(MalformedEnv(), on_group_fn=collector, max_new_tokens=16)
  runner.connect(lambda episode: pytest.fail("must not resume"))
  request = _request(group_size=2)
  runner.submit(_episode(request, 0, [91, CALL_END]))
  runner.submit(_episode(request, 1, [52, EOS]))
  assert collector.arrived.wait(5)
  runner.close()
  runner.raise_if_failed()
  assert [r.finish_reason for r in collector.groups[0].rollouts] == ["error", "error"]
  assert runner.errors == {"malformed": 2}


class OutOfVocabularyEnv(CalculatorEnv):
  """Answers with a token id the model has no embedding for."""

  name = "out_of_vocab"

  def step(self, prompt, completion_ids):
    return [61, 300] if completion_ids[-1] == CALL_END else None


def test_observation_ids_outside_the_vocabulary_are_environment_faults():
  collector = Collector()
  runner = env_runner_lib.EnvRunner(OutOfVocabularyEnv(), on_group_fn=collector,
                                    max_new_tokens=16, vocab_size=259)
  runner.connect(lambda episode: pytest.fail("must not resume"))
  request = _request(group_size=1)
  runner.submit(_episode(request, 0, [91, CALL_END]))
  assert collector.arrived.wait(5)
  runner.close()
  runner.raise_if_failed()
  assert collector.groups[0].rollouts[0].finish_reason == "error"
  assert runner.errors == {"out_of_vocab": 1}


def test_assemble_lays_out_rows_like_the_sampler():
  group = make_group(3, 5, [[5, 6], [6]])
  batch = train_batch_lib.assemble([group], prompt_len=4, max_new_tokens=3, pad_id=256,
                                   advantage_estimator="grpo")
  np.testing.assert_array_equal(batch.tokens[0], [256, 256, 1, 2, 0, 1, 256])
  np.testing.assert_array_equal(batch.token_mask[1], [0, 0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(batch.token_versions[0], [-1, -1, -1, -1, 5, 6, -1])
  np.testing.assert_array_equal(batch.positions[0], [0, 0, 0, 1, 2, 3, 0])
  np.testing.assert_array_equal(batch.segment_ids[1], [0, 0, 1, 1, 1, 0, 0])
  # Rewards 0 and 1: each rollout's advantage on its tokens.
  np.testing.assert_allclose(batch.advantages[:, 4], [-1, 1], atol=1e-5)
  np.testing.assert_allclose(batch.advantages[1], [0, 0, 1, 1, 1, 0, 0], atol=1e-5)


def test_a_worker_bug_is_surfaced_not_swallowed():
  runner = env_runner_lib.EnvRunner(FlakyEnv(), on_group_fn=lambda g: None, max_new_tokens=8,
                                    num_workers=1)
  request = _request(group_size=1, prompt=object())  # no prompt_id: a bug, not an env fault
  runner.submit(_episode(request, 0, [1, EOS]))
  runner.close()
  with pytest.raises(RuntimeError, match="environment worker failed"):
    runner.raise_if_failed()


class PartsEnv(env_api.Environment):
  """Scores with a `Score`: the first token's value as a part, an outcome by it."""

  name = "parts"

  def encode_prompt(self, prompt):
    return [1, 2]

  def score(self, prompt, completion_ids):
    first = completion_ids[0]
    if first == 66:
      return env_api.Score(1.0, {"bad": float("nan")})
    return env_api.Score(float(first == 1), {"first": float(first)},
                         outcome="right" if first == 1 else "wrong")


def test_a_score_carries_its_parts_and_outcome_to_the_rollout_and_the_counters():
  collector = Collector()
  runner = env_runner_lib.EnvRunner(PartsEnv(), on_group_fn=collector, max_new_tokens=8,
                                    num_workers=2)
  request = _request(group_size=4)
  for index, first in enumerate((1, 2, 1, 66)):
    runner.submit(_episode(request, index, [first, EOS]))
  assert collector.arrived.wait(5)
  (group,) = collector.groups
  assert [r.reward for r in group.rollouts] == [1.0, 0.0, 1.0, 0.0]
  assert [r.outcome for r in group.rollouts] == ["right", "wrong", "right", ""]
  assert group.rollouts[1].reward_parts == {"first": 2.0}
  # A non-finite part is the environment's fault, like a non-finite reward.
  assert group.rollouts[3].finish_reason == "error" and runner.errors == {"parts": 1}
  assert runner.metrics()["env_outcomes"] == {"parts/right": 2, "parts/wrong": 1}
  restored = env_runner_lib.EnvRunner(PartsEnv(), on_group_fn=collector, max_new_tokens=8)
  restored.load_state_dict(runner.state_dict())
  assert restored.metrics() == runner.metrics()
  restored.load_state_dict({"errors": {}, "timeouts": {}, "turns": 0})  # (older checkpoints)
  runner.close()
  restored.close()
