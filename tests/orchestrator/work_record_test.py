"""The open-work record: typed, round-trips through JSON, reads the untyped
layout of earlier checkpoints, and names the field it cannot read."""

import copy
import dataclasses
import json
import os

import pytest

from arl_jax.orchestrator import work_record

OLD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                   "main_46acdb4", "tool_agent", "checkpoints", "2", "run", "metadata")


def _old_work() -> dict:
  return json.load(open(OLD))["work"]


def test_an_old_record_reads_and_round_trips():
  old = _old_work()
  work = work_record.WorkRecord.from_json(old)
  assert work.version == work_record.WORK_VERSION
  assert len(work.groups) == len(old["groups"]) and work.prompts_drawn == old["prompts_drawn"]
  stages = {e.stage for g in work.groups for e in g.episodes}
  assert stages <= set(work_record.STAGES) and "sample" in stages
  again = work.to_json()
  assert again["version"] == work_record.WORK_VERSION
  assert {k: v for k, v in again.items() if k != "version"} == old
  assert work_record.WorkRecord.from_json(json.loads(json.dumps(again))) == work


@pytest.mark.parametrize("change, message", [
    (lambda w: w.pop("stream_state"), r"work\.stream_state: missing"),
    (lambda w: w.update(prompts_drawn="7"), r"work\.prompts_drawn: must be int"),
    (lambda w: w.update(version=99), r"work\.version: 99 is newer than this code reads"),
    (lambda w: w["groups"][0].pop("dispatch_version"),
     r"work\.groups\[0\]\.dispatch_version: missing"),
    (lambda w: w["groups"][0]["episodes"][1].update(stage="thinking"),
     r"work\.groups\[0\]\.episodes\[1\]\.stage: unknown restart point 'thinking'"),
    (lambda w: w["groups"][0]["episodes"][0]["loss_mask"].append(1.0),
     r"work\.groups\[0\]\.episodes\[0\]: completion_ids, loss_mask, logprobs and versions "
     r"differ in length"),
    (lambda w: w["groups"][0]["episodes"][0].update(logprobs=["x"]),
     r"work\.groups\[0\]\.episodes\[0\]\.logprobs: not a list of floats"),
    (lambda w: w["requeued"].append(["p"]), r"work\.requeued\[0\]: must be \[prompt, attempt\]"),
    (lambda w: w["counters"].pop("started"), r"work\.counters\.started: missing"),
])
def test_a_damaged_record_names_the_field(change, message):
  work = copy.deepcopy(_old_work())
  for episode in work["groups"][0]["episodes"]:  # (a group whose first rollout has tokens)
    episode.setdefault("completion_ids", [])
  change(work)
  with pytest.raises(work_record.WorkRecordError, match=message):
    work_record.WorkRecord.from_json(work)


def test_a_scored_rollouts_parts_and_outcome_round_trip_and_are_checked():
  done = work_record.EpisodeRecord(
      stage="done", completion_ids=(5, 6), loss_mask=(1.0, 1.0), logprobs=(-0.1, -0.2),
      versions=(0, 0), finish_reason="stop", reward=0.5, env_name="humaneval",
      reward_parts={"fraction_passed": 0.5, "all_passed": 0.0}, outcome="failed_tests")
  record = json.loads(json.dumps(done.to_json()))
  assert work_record.EpisodeRecord.from_json(record, "e") == done
  plain = dataclasses.replace(done, reward_parts={}, outcome="")
  assert "outcome" not in plain.to_json() and "reward_parts" not in plain.to_json()
  record["reward_parts"]["judge"] = "yes"
  with pytest.raises(work_record.WorkRecordError, match=r"e\.reward_parts\.judge: must be float"):
    work_record.EpisodeRecord.from_json(record, "e")
