"""Deterministic replay (`core/schedule.py`): a recorded asynchronous run, run
again from its schedule, reaches the same params bit for bit (each update's
params fingerprint is checked) and the same logged numbers, across a resume
too; a tampered schedule names the first update that differs and what; and
`arl_jax.diff` points at where two runs part."""

import json
import os

import pytest

from arl_jax import diff as diff_lib
from arl_jax.core import schedule
from arl_jax.testing import tiny
from arl_jax.training import replay, run_lib
from arl_jax.training import stop as stop_lib


def _config(num_steps=30, **replay_keys):
  config = tiny.load_config("arith", "tiny")
  config.num_steps = num_steps
  config.eval_every = 0
  config.log_every = 1  # (a progress line each update: a test stops a run at one)
  # Lag 1 at most while the sampler runs 2 batches ahead: groups are swept
  # stale and cancelled in flight, and swaps fall between decode steps.
  config.orchestrator.update(max_off_policy_steps=1, max_async_level=2,
                             # (rewards that differ within a group: the params move)
                             overlong_buffer=2, overlong_penalty=1.0)
  config.sampler.max_new_tokens = 8  # (longer generations: more still in flight at a publish)
  config.replay.update(**replay_keys)
  return config


def _rows(workdir, name="metrics.jsonl"):
  return [json.loads(line) for line in open(os.path.join(workdir, name))]


def _updates(workdir):
  return [r for r in _rows(workdir) if r.get("phase") == "rl" and "loss" in r]


def _eventful(workdir) -> bool:
  """The recorded run cancelled groups in flight and trained rows sampled by
  two versions (swaps between decode steps)."""
  events = schedule.read_events(workdir)
  return (any(e["e"] == "publish" and e["cancel"] for e in events)
          and any(r["multi_version_fraction"] > 0 for r in _updates(workdir)))


def _differences(ours, theirs) -> list[tuple]:
  """`(step, key, ours, theirs)` of every comparable number that differs."""
  out = []
  for a, b in zip(ours, theirs, strict=True):
    a, b = diff_lib.comparable(a), diff_lib.comparable(b)
    out += [(a.get("step"), k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]
  return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
  # The clock decides whether a run cancels anything (most do): recorded
  # again, up to twice, until one did.
  for _ in range(3):
    workdir = str(tmp_path_factory.mktemp("recorded"))
    run_lib.run(_config(record=True), workdir, print_fn=lambda line: None)
    if _eventful(workdir):
      break
  return workdir


def test_a_replay_of_an_asynchronous_run_reaches_the_same_params(recorded, tmp_path):
  events = schedule.read_events(recorded)
  assert sum(1 for e in events if e["e"] == "update") == 30
  # In-flight updates (swaps while slots decode) and cancellations happened.
  assert sum(1 for e in events if e["e"] == "offer") > 10
  assert _eventful(recorded)

  result = replay.run(_config(from_run=recorded), str(tmp_path), print_fn=lambda line: None)
  assert result.complete and result.final_version == 30
  ours, theirs = _updates(tmp_path), _updates(recorded)
  assert [r["params_hash"] for r in ours] == [r["params_hash"] for r in theirs]
  assert len(set(r["params_hash"] for r in ours)) > 20  # (the params did move)
  assert _differences(ours, theirs) == []
  assert _rows(tmp_path, "groups.jsonl") == _rows(recorded, "groups.jsonl")
  assert diff_lib.main([recorded, str(tmp_path)]) == 0


def test_a_tampered_schedule_names_the_first_update_that_differs(recorded, tmp_path):
  events = schedule.read_events(recorded)
  for event in events:
    if event["e"] == "update" and event["u"] == 3:
      event["tok"] = "0" * 16
  source = tmp_path / "tampered"
  source.mkdir()
  (source / schedule.FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
  with pytest.raises(schedule.ReplayDiverged, match="update 3: the batch's tokens differ") as e:
    replay.run(_config(from_run=str(source)), str(tmp_path / "replay"),
               print_fn=lambda line: None)
  assert e.value.step == 3 and e.value.recorded == "0" * 16

  # A sampler decision: the second admission starts other groups.
  events = schedule.read_events(recorded)
  take = [e for e in events if e["e"] == "take"][1]
  take["g"] = [g + 100 for g in take["g"]]
  (source / schedule.FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
  with pytest.raises(schedule.ReplayDiverged, match="the next group id differs"):
    replay.run(_config(from_run=str(source)), str(tmp_path / "replay2"),
               print_fn=lambda line: None)


def test_a_replay_goes_through_the_recorded_run_s_resume(tmp_path):
  config = _config(num_steps=12, record=True)
  # Saved every 4 updates, not at the stop: the stop at 6 resumes from 4 and
  # the schedule's lines after that checkpoint are set aside.
  config.checkpoint.update(every_steps=4, save_final=False)
  recorded, replayed = str(tmp_path / "recorded"), str(tmp_path / "replayed")
  stop = stop_lib.StopRequest()

  def print_fn(line):
    if line.startswith("step    5 "):
      stop.request("test")

  first = run_lib.run(config, recorded, print_fn=print_fn, stop=stop)
  assert not first.complete and first.saved_version == 4
  assert run_lib.run(config, recorded, print_fn=lambda line: None).final_version == 12
  assert [s.version for s in schedule.load(recorded)] == [0, 4]

  config = _config(num_steps=12, from_run=recorded)
  config.checkpoint.update(every_steps=4, save_final=False)
  lines = []
  result = replay.run(config, replayed, print_fn=lines.append)
  assert result.complete and result.final_version == 12
  assert any("resumed from" in line and "at version 4" in line for line in lines)
  assert [r["params_hash"] for r in _updates(replayed)] == [
      r["params_hash"] for r in _updates(recorded)]
  assert diff_lib.main([recorded, replayed]) == 0


def test_a_bfloat16_run_replays_to_the_same_params(tmp_path):
  """Nothing in the scheme depends on the dtype: bfloat16 params on both
  roles (the sampler's rounding included) replay bit for bit."""
  config = _config(num_steps=8, record=True)
  config.model.param_dtype = config.sampler.param_dtype = "bfloat16"
  recorded, replayed = str(tmp_path / "recorded"), str(tmp_path / "replayed")
  run_lib.run(config, recorded, print_fn=lambda line: None)
  config = _config(num_steps=8, from_run=recorded)
  config.model.param_dtype = config.sampler.param_dtype = "bfloat16"
  assert replay.run(config, replayed, print_fn=lambda line: None).final_version == 8
  hashes = [r["params_hash"] for r in _updates(recorded)]
  assert len(set(hashes)) > 4  # (the params did move)
  assert [r["params_hash"] for r in _updates(replayed)] == hashes
  assert _differences(_updates(replayed), _updates(recorded)) == []


def test_diff_points_at_the_first_update_of_two_seeds(recorded, tmp_path, capsys):
  config = _config(num_steps=2, record=True)
  config.seed = 1
  config.warmup.steps = 0
  other = str(tmp_path / "other")
  run_lib.run(config, other, print_fn=lambda line: None)
  config.seed = 2
  run_lib.run(config, str(tmp_path / "third"), print_fn=lambda line: None)
  capsys.readouterr()
  assert diff_lib.main([other, str(tmp_path / "third")]) == 1
  out = capsys.readouterr().out
  assert out.startswith("first difference: update 0 (version 1)")
  assert "update 0: the batch's" in out


def test_diff_refuses_bad_input_in_one_line(recorded, tmp_path, capsys):
  assert diff_lib.main([recorded, str(tmp_path / "missing")]) == 2
  assert "no such run folder" in capsys.readouterr().err
  broken = tmp_path / "broken"
  broken.mkdir()
  assert diff_lib.main([recorded, str(broken)]) == 2
  assert "metrics.jsonl: missing" in capsys.readouterr().err
  lines = open(os.path.join(recorded, "metrics.jsonl")).read().splitlines(keepends=True)
  (broken / "metrics.jsonl").write_text("".join(lines[:3]) + '{"step": 3, "lo\n' + lines[4])
  assert diff_lib.main([recorded, str(broken)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error:") and "metrics.jsonl:4: not a JSON line" in err
  (broken / "metrics.jsonl").write_text("".join(lines[:5]) + lines[5][:20])  # (a torn last line)
  (broken / schedule.FILE).write_text('{"e": "take"}\n')
  assert diff_lib.main([recorded, str(broken)]) == 2
  assert "schedule.jsonl:1: a take event lacks its 'n' field" in capsys.readouterr().err
  assert diff_lib.main(["only-one"]) == 2
  with pytest.raises(schedule.ScheduleError, match="no schedule"):
    schedule.load(str(tmp_path))
