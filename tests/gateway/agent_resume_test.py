"""An agent run resumed from a checkpoint loses nothing and trains nothing
twice: a group's rollouts done at the save keep their exact tokens (with
their own prompt: an agent's session renders it), the others are played
again by their agent."""

import asyncio
import dataclasses
import itertools
import json

import numpy as np
import orbax.checkpoint as ocp
import pytest

from arl_jax.config import builtin
from arl_jax.core import episode as episode_lib
from arl_jax.core import group_request
from arl_jax.envs import env_api
from arl_jax.gateway import agent_config
from arl_jax.orchestrator import open_work, work_record
from arl_jax.testing import tiny
from arl_jax.training import run_lib
from arl_jax.training import stop as stop_lib

pytest.importorskip("fastapi")


_calls, _done = itertools.count(), itertools.count()
_STOP = {"request": None, "after_done": 0}  # the first run's stop, and when it is asked


async def some_stuck(*, base_url, model, prompt, api_key, env, http_client):
  """configs/openai_agent.py's agent, every fourth call of the first run stuck
  (cancelled at the stop): the save finds groups part done, whose done
  rollouts must be kept and whose stuck ones played again."""
  if _STOP["request"] is not None and next(_calls) % 4 == 3:
    await asyncio.sleep(600)
  lookup = agent_config.load_function(builtin.path("openai_agent") + ":lookup_agent")
  reward = await lookup(base_url=base_url, model=model, prompt=prompt, api_key=api_key, env=env,
                        http_client=http_client)
  if _STOP["request"] is not None and next(_done) == _STOP["after_done"]:
    _STOP["request"].request("the test saves here")
  return reward


def test_a_resumed_agent_run_loses_no_prompt_and_repeats_none(tmp_path):
  config = tiny.load_config("openai_agent", "tiny")
  config.orchestrator.update(max_async_level=2, max_off_policy_steps=8)
  config.agent.function = f"{__name__}:some_stuck"
  config.eval_every = 0
  config.num_steps = 8  # (the stop comes first)
  config.checkpoint = {"save_final": True}
  _STOP.update(request=stop_lib.StopRequest(), after_done=8)
  first = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None, keep_batches=True,
                      stop=_STOP["request"])
  assert first.stop_reason == "the test saves here"
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), item_names=("state", "run"))
  record = manager.restore(manager.latest_step(),
                           args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
  groups = record["work"]["groups"]
  unfinished = [g["prompt"]["prompt_id"] for g in groups]
  stages = [e["stage"] for g in groups for e in g["episodes"]]
  assert set(stages) == {"sample", "done"}  # (an agent's session restarts or is done)
  _STOP["request"] = None  # (no agent is stuck from here on)
  second = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None, keep_batches=True)
  assert second.complete
  trained_first = [p for b in first.trained_batches for p in b["prompt_ids"]]
  trained_second = [p for b in second.trained_batches for p in b["prompt_ids"]]
  trained = trained_first + trained_second
  assert len(trained) == len(set(trained))
  assert not set(unfinished) & set(trained_first)
  assert set(unfinished) <= set(trained_second)
  # Every rollout done at the save is trained as it was saved.
  g, p = config.orchestrator.group_size, config.sampler.prompt_len
  rows = {(gid, s): batch["tokens"][j * g + s]
          for batch in second.trained_batches for j, gid in enumerate(batch["group_ids"])
          for s in range(g)}
  kept = 0
  for saved in groups:
    for s, episode in enumerate(saved["episodes"]):
      if episode["stage"] != "done" or (saved["group_id"], s) not in rows:
        continue
      tokens = rows[(saved["group_id"], s)]
      prompt = episode.get("prompt_ids", saved["prompt_ids"])
      assert tokens[p - len(prompt):p].tolist() == prompt
      n = len(episode["completion_ids"])
      assert tokens[p:p + n].tolist() == episode["completion_ids"]
      kept += 1
  assert kept == stages.count("done")


def test_a_done_rollout_with_its_own_prompt_is_saved_and_restored_with_it():
  """A chat agent's session renders its own prompt (system turn, tools), so
  a rollout's prompt may differ from its group's: the save keeps it."""
  request = group_request.GroupRequest(
      group_id=9, prompt=env_api.TextPrompt(prompt_id=4, text="k4?", answer="1"),
      prompt_ids=(1, 2, 3), dispatch_version=2, group_size=2, dispatch_time=0.0)
  work = open_work.OpenWork()
  work.open(request)
  own = episode_lib.Episode(request=request, sample_index=0, completion_ids=[5, 6],
                            loss_mask=[1.0, 1.0], logprobs=[-0.5, -0.25],
                            versions=[2, 2]).to_rollout(finish_reason="stop", reward=1.0)
  own.prompt_ids = np.asarray([7, 8, 9, 10], np.int32)
  same = episode_lib.Episode(request=request, sample_index=1, completion_ids=[5],
                             loss_mask=[1.0], logprobs=[-0.5],
                             versions=[2]).to_rollout(finish_reason="stop", reward=0.0)
  work.scored(own)
  work.scored(same)
  (saved,) = work.snapshot({}, prompt_to_json=dataclasses.asdict)
  loaded = work_record.GroupRecord.from_json(json.loads(json.dumps(saved.to_json())), "g")
  assert "prompt_ids" in saved.to_json()["episodes"][0]
  assert "prompt_ids" not in saved.to_json()["episodes"][1]
  restored = open_work.OpenWork().restore_group(loaded, request)
  first, second = restored.complete.rollouts
  assert first.prompt_ids.tolist() == [7, 8, 9, 10] and second.prompt_ids.tolist() == [1, 2, 3]
