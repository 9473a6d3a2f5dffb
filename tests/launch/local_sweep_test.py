"""The local sweep runner: grid expansion, subprocess runs, summary tables."""

import os
import re

import pytest

from launch import local_sweep


def test_expand_is_the_cartesian_product_with_readable_names():
  points = local_sweep.expand(local_sweep.parse_sweep(["orchestrator.max_off_policy_steps=0,8",
                                                       "learner.lr=1e-4"]))
  assert [p.name for p in points] == ["orchestrator.max_off_policy_steps=0,learner.lr=1e-4",
                                      "orchestrator.max_off_policy_steps=8,learner.lr=1e-4"]
  assert points[1].overrides == (("orchestrator.max_off_policy_steps", "8"),
                                 ("learner.lr", "1e-4"))
  with pytest.raises(ValueError, match="expected KEY=V1,V2"):
    local_sweep.parse_sweep(["learner.lr"])


def test_tuple_values_are_one_value_each():
  [(key, values)] = local_sweep.parse_sweep(["sampler.prompt_buckets=(4,8), (8, [16,2]),()"])
  assert key == "sampler.prompt_buckets" and values == ["(4,8)", "(8, [16,2])", "()"]
  for bad, message in [("k=(4,8", "')' missing"), ("k=4,8)", "unbalanced ')'"),
                       ("k=(4,8]", "unbalanced ']'"), ("k=1,,2", "an empty value")]:
    with pytest.raises(ValueError, match=re.escape(message)):
      local_sweep.parse_sweep([bad])


def test_sweep_runs_points_and_reports_failures(tmp_path):
  root = str(tmp_path)
  points = local_sweep.expand(local_sweep.parse_sweep(
      ["num_steps=2", "orchestrator.max_off_policy_steps=4,-1"]))
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  cwd = os.getcwd()
  os.chdir(repo)
  try:
    rows = local_sweep.run_sweep("configs/arith.py:tiny", root, points, parallel=2,
                                 log=lambda *_: None)
  finally:
    os.chdir(cwd)
  ok, bad = rows
  assert ok["exit_code"] == 0 and ok["version"] == 2 and "eval_reward" in ok
  assert bad["exit_code"] != 0 and "max_off_policy_steps" in bad["error"]
  summary = open(os.path.join(root, "summary.md")).read()
  assert "max_off_policy_steps=4" in summary and "max_off_policy_steps=-1" in summary
  assert os.path.exists(os.path.join(root, "summary.csv"))
