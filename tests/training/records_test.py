"""A resumed or restarted run's records keep exactly the lines of the point it starts from."""

import json
import os

from arl_jax.training import records


def _write(path, lines, torn=""):
  with open(path, "w") as f:
    f.writelines(json.dumps({"step": i}) + "\n" for i in lines)
    f.write(torn)


def _steps(path):
  return [json.loads(line).get("step") for line in open(path)]


def test_lines_after_the_position_move_aside_with_a_marker(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  _write(path, range(5), torn='{"step": 5, "lo')  # a kill mid-write
  assert records.keep_lines(path, 3, "resumed from version 3") == 3
  assert _steps(path) == [0, 1, 2]
  aside = open(records.superseded_path(path)).read().splitlines()
  marker = json.loads(aside[0])
  assert marker["superseded"] == 3 and marker["reason"] == "resumed from version 3"
  assert [json.loads(line)["step"] for line in aside[1:3]] == [3, 4]
  assert aside[3] == '{"step": 5, "lo'  # the torn line is kept as it was


def test_nothing_moves_when_the_file_ends_at_the_position(tmp_path):
  path = str(tmp_path / "groups.jsonl")
  _write(path, range(4))
  assert records.keep_lines(path, 4, "x") == 0
  assert records.keep_lines(path, 10, "x") == 0
  assert _steps(path) == [0, 1, 2, 3]
  assert not os.path.exists(records.superseded_path(path))


def test_a_fresh_start_sets_every_earlier_line_aside(tmp_path):
  _write(str(tmp_path / "metrics.jsonl"), range(2))
  _write(str(tmp_path / "groups.jsonl"), range(3))
  moved = records.reconcile(str(tmp_path), None, "started over")
  assert moved == {"metrics.jsonl": 2, "groups.jsonl": 3}
  assert os.path.getsize(tmp_path / "metrics.jsonl") == 0
  assert "2 line(s) of metrics.jsonl -> metrics.superseded.jsonl" in records.describe(
      moved, str(tmp_path))
  # Set aside twice: the superseded file grows, nothing is lost.
  _write(str(tmp_path / "metrics.jsonl"), range(7))
  records.reconcile(str(tmp_path), {"metrics.jsonl": 6, "groups.jsonl": 0}, "resumed")
  markers = [json.loads(x) for x in open(tmp_path / "metrics.superseded.jsonl")
             if "superseded" in json.loads(x)]
  assert [m["superseded"] for m in markers] == [2, 1]
