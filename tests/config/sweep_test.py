"""Sweeps defined next to the config: helpers, config sweeps, the XManager job specs."""

import os

import pytest

from arl_jax.config import run_spec, sweep
from arl_jax.testing import tiny
from launch import local_sweep, xm_launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_product_and_zip_build_override_dicts():
  modes = sweep.zip_(sweep.axis("a.k", [0, 8]), sweep.axis("a.mode", ["sync", "async"]))
  assert modes == [{"a.k": 0, "a.mode": "sync"}, {"a.k": 8, "a.mode": "async"}]
  points = sweep.product(modes, sweep.axis("seed", [0, 1]))
  assert [sweep.name_of(p) for p in points] == [
      "a.k=0,a.mode=sync,seed=0", "a.k=0,a.mode=sync,seed=1",
      "a.k=8,a.mode=async,seed=0", "a.k=8,a.mode=async,seed=1"]
  with pytest.raises(ValueError, match="different lengths"):
    sweep.zip_(sweep.axis("a", [1, 2]), sweep.axis("b", [1]))
  with pytest.raises(ValueError, match=r"key\(s\) \['a'\] appear in more than one axis"):
    sweep.product(sweep.axis("a", [1]), sweep.axis("a", [2]))
  with pytest.raises(ValueError, match="no values"):
    sweep.axis("a", [])


@pytest.mark.parametrize("name, size", [("arith", 6), ("tool_agent", 4)])
def test_every_point_of_a_config_sweep_is_a_valid_config(name, size):
  points = sweep.from_config(os.path.join(REPO, f"configs/{name}.py"))
  assert len(points) == size and len({sweep.name_of(p) for p in points}) == size
  for point in points:
    config = tiny.load_config(name, "tiny")
    config.update_from_flattened_dict(point)
    run_spec.build(config)  # raises ConfigError naming a bad key or value


def test_a_config_without_a_sweep_says_so():
  with pytest.raises(ValueError, match="defines no get_sweep"):
    sweep.from_config(os.path.join(REPO, "configs/math_answer.py"))
  with pytest.raises(ValueError, match="no config file"):
    sweep.from_config("configs/missing.py")


def test_config_points_times_flag_axes():
  config = os.path.join(REPO, "configs/tool_agent.py:tiny")
  axes = local_sweep.expand(local_sweep.parse_sweep(["learner.lr=1e-4,3e-4"]))
  points = local_sweep.combine(local_sweep.config_points(config), axes)
  assert len(points) == 8
  assert points[0].overrides[-1] == ("learner.lr", "1e-4")
  jobs = xm_launch.job_specs("configs/tool_agent.py", "gs://b/x/", points)
  assert jobs[0].args["workdir"] == f"gs://b/x/{points[0].name}"
  assert jobs[0].args["config.orchestrator.max_async_level"] == "0"
