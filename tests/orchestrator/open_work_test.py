"""Open work survives a checkpoint: every group at its restart points, through JSON."""

import itertools
import json

import numpy as np
import pytest

from arl_jax.core import episode as episode_lib
from arl_jax.core import rollout as rollout_lib
from arl_jax.envs import env_api
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.orchestrator import orchestrator_config, work_record


def _orchestrator(group_size=2, first_prompt=0):
  k = 4
  prompts = (env_api.TextPrompt(prompt_id=i, text=f"p{i}", answer="a")
             for i in itertools.count(first_prompt))
  return orchestrator_lib.Orchestrator(
      orchestrator_config.OrchestratorConfig(
          group_size=group_size, batch_size=2 * group_size, max_async_level=1,
          max_off_policy_steps=k, staleness_reference="oldest_token"),
      prompts=prompts, encode_fn=lambda p: [5, p.prompt_id % 7 + 1], env_name_of=lambda p: "t",
      max_new_tokens=16)


def _sampled(episode, tokens, version, stopped=True):
  episode.add_segment(tokens, [-0.25 * (i + 1) for i in range(len(tokens))],
                      [version] * len(tokens), stopped=stopped)


def _save_then_restore(orch, partials, exclude=()):
  work = json.loads(json.dumps(orch.dispatcher.snapshot_work(partials, exclude).to_json()))
  fresh = _orchestrator(first_prompt=1000)  # a stream that is not the saved one's
  fresh.publish(3, trained=[])
  return work, fresh, {g.group_id: g for g in fresh.restore_work(work_record.WorkRecord.from_json(work))}


def test_every_restart_point_round_trips_through_json():
  orch = _orchestrator()
  orch.publish(1, trained=[])
  requests = orch.dispatcher.take(4, live_version=1, timeout=0.01)  # groups 0-3
  work = orch.work
  # Group 0: both rollouts scored, in the buffer.
  done = [episode_lib.Episode(request=requests[0], sample_index=i) for i in range(2)]
  rollouts = []
  for i, e in enumerate(done):
    _sampled(e, [9, 2], version=1)
    rollouts.append(e.to_rollout(finish_reason="stop", reward=float(i), env_name="t"))
    work.scored(rollouts[-1])
  orch.group_finished(rollout_lib.Group(group_id=0, prompt_id=0, dispatch_version=1,
                                        rollouts=rollouts))
  # Group 1: one rollout scored, the other at its environment after a turn.
  a, b = (episode_lib.Episode(request=requests[1], sample_index=i) for i in range(2))
  _sampled(a, [3], version=1)
  work.scored(a.to_rollout(finish_reason="length", reward=0.5, env_name="t"))
  _sampled(b, [4, 4], version=1)
  b.add_observation([7, 7, 7])
  work.at_sampler(b)
  _sampled(b, [6], version=2)
  work.at_env(b)
  b.add_observation([8])  # the env call was under way: not part of the restart point
  # Group 2: one episode mid-segment in a sampler slot, one still waiting (fresh).
  partials = {(2, 0): (np.array([11, 12]), np.array([-1.5, -0.5], np.float32),
                       np.array([2, 3]))}
  # Group 3 was just trained: left out.
  saved, fresh, restored = _save_then_restore(orch, partials, exclude=[3])

  assert [g["group_id"] for g in saved["groups"]] == [0, 1, 2]
  assert (saved["prompts_drawn"], saved["next_group_id"]) == (4, 4)
  # Group 0 is back in the buffer at the version it arrived at, eligible as before.
  assert restored[0].complete is not None and restored[0].arrival_version == 1
  assert len(fresh.buffer) == 1
  # Group 1: the scored rollout waits for its sibling, which goes to its env again.
  (scored,), (at_env,) = restored[1].scored, restored[1].to_env
  assert (scored.reward, scored.finish_reason, scored.completion_ids.tolist()) == (
      0.5, "length", [3])
  assert at_env.completion_ids == [4, 4, 7, 7, 7, 6]
  assert at_env.loss_mask == [1, 1, 0, 0, 0, 1]
  assert at_env.versions == [1, 1, -1, -1, -1, 2]
  assert at_env.logprobs == [-0.25, -0.5, 0.0, 0.0, 0.0, -0.25]
  assert (at_env.turns, at_env.last_stopped) == (2, True)
  assert restored[1].oldest_sampled == 1
  # Group 2: the open segment comes back exactly (float32 through JSON), then a fresh one.
  first, second = restored[2].to_sample
  assert (first.open_tokens, first.open_versions) == ([11, 12], [2, 3])
  np.testing.assert_array_equal(np.float32(first.open_logprobs), np.float32([-1.5, -0.5]))
  assert first.context_ids() == [5, 3, 11, 12] and first.length == 2
  assert (second.completion_ids, second.open_tokens) == ([], [])
  assert restored[2].oldest_sampled == 2
  # Dispatch versions and ids are kept; new groups continue after the last id.
  assert {r.dispatch_version for r in (first.request, at_env.request)} == {1}
  (new,) = fresh.dispatcher.take(1, live_version=3, timeout=0.01)
  assert (new.group_id, new.prompt.prompt_id) == (4, 1000)
  assert fresh.dispatcher.num_started == 5
  # Saving again right away gives the same open work (restored points are recorded).
  again = json.loads(json.dumps(fresh.dispatcher.snapshot_work({}).to_json()))
  assert again["groups"][:3] == saved["groups"]


def test_a_restored_group_that_can_no_longer_ship_is_cancelled_at_the_first_publish():
  orch = _orchestrator()
  orch.dispatcher.take(1, live_version=0, timeout=0.01)
  _, fresh, _ = _save_then_restore(orch, {(0, 1): ([1], [-0.1], [0])})
  assert fresh.publish(4, trained=[]) == []
  assert fresh.publish(5, trained=[]) == [0]  # its oldest token is from 0, K=4: lag 5 > 4


def test_a_group_size_change_is_named():
  orch = _orchestrator()
  orch.dispatcher.take(1, live_version=0, timeout=0.01)
  work = work_record.WorkRecord.from_json(orch.dispatcher.snapshot_work({}).to_json())
  with pytest.raises(ValueError, match="saved with 2 rollouts.*groups of 3"):
    _orchestrator(group_size=3).restore_work(work)
