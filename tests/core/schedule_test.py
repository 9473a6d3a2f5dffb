"""The schedule file's reader refuses what is not a schedule, naming the line."""

import json

import pytest

from arl_jax.core import schedule


def _write(tmp_path, *events) -> str:
  (tmp_path / schedule.FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
  return str(tmp_path)


_GOOD = ({"e": "segment", "v": 0}, {"e": "take", "n": 0, "g": [3, 4], "a": [0, 0]},
         {"e": "offer", "n": 2, "v": 1, "s": "swap"}, {"e": "arrive", "g": 3, "v": 0},
         {"e": "cut", "u": 1, "stale": [], "g": None},
         {"e": "update", "u": 1, "v": 1, "tok": "ab", "ver": "cd", "par": "ef"})


def test_a_good_schedule_loads_into_its_streams(tmp_path):
  [segment] = schedule.load(_write(tmp_path, *_GOOD))
  assert segment.version == 0
  assert [e["e"] for e in segment.engine[0]] == ["take"]
  assert [e["e"] for e in segment.engine[2]] == ["offer"]
  assert [e["e"] for e in segment.learner] == ["cut", "update"]
  assert segment.arrivals == {3: 0}


@pytest.mark.parametrize("bad, message", [
    ({"e": "take", "n": "x", "g": [1], "a": [0]}, "'n' must be a whole number, got 'x'"),
    ({"e": "take", "n": 1, "g": [1.5], "a": [0]}, "'g' must be a list of whole numbers"),
    ({"e": "take", "n": True, "g": [1], "a": [0]}, "'n' must be a whole number, got True"),
    ({"e": "cut", "u": 1, "stale": [], "g": "all"}, "'g' must be a list of whole numbers or null"),
    ({"e": "update", "u": 1, "v": 1, "tok": 7, "ver": "", "par": ""}, "'tok' must be a string"),
    ({"e": "arrive", "g": [1], "v": 0}, "'g' must be a whole number"),
    ({"e": "publish", "v": 2}, "a publish event lacks its 'cancel' field"),
    ({"e": "weather", "v": 2}, "not a schedule event"),
    (["segment", 0], "not a schedule event"),
])
def test_a_wrong_field_is_named_with_its_file_and_line(tmp_path, bad, message):
  run = _write(tmp_path, *_GOOD[:2], bad)
  with pytest.raises(schedule.ScheduleError) as raised:
    schedule.load(run)
  assert f"{schedule.FILE}:3: " in str(raised.value)
  assert message in str(raised.value)


def test_a_torn_last_line_is_left_out_but_a_torn_middle_one_is_not(tmp_path):
  run = _write(tmp_path, *_GOOD)
  path = tmp_path / schedule.FILE
  path.write_text(path.read_text() + '{"e": "take", "n"')
  assert len(schedule.read_events(run)) == len(_GOOD)
  path.write_text('{"e": "segment", "v": 0}\n{"e": "ta\n' + json.dumps(_GOOD[1]) + "\n")
  with pytest.raises(schedule.ScheduleError, match=f"{schedule.FILE}:2: not JSON"):
    schedule.read_events(run)


def test_a_schedule_starts_with_a_segment(tmp_path):
  with pytest.raises(schedule.ScheduleError, match=":1: a schedule starts with a segment"):
    schedule.load(_write(tmp_path, *_GOOD[1:]))
  (tmp_path / schedule.FILE).write_text("")
  with pytest.raises(schedule.ScheduleError, match="is empty"):
    schedule.load(str(tmp_path))
