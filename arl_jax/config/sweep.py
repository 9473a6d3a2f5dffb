"""Sweeps defined next to the config (big_vision style).

A config file may define `get_sweep(arg)` returning a list of override dicts,
one per run, built with these helpers:

  from arl_jax.config import sweep

  def get_sweep(arg=None):
    return sweep.product(
        sweep.axis("orchestrator.max_off_policy_steps", [0, 2, 8]),
        sweep.axis("seed", [0, 1]))

`launch.local_sweep --from_config` runs them as local subprocesses and
`launch.xm_launch` turns them into one XManager job each. Keys are dotted
config paths, exactly as `--config.<key>=<value>` overrides.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from collections.abc import Sequence

from arl_jax.config import builtin

Overrides = dict[str, object]


def axis(key: str, values: Sequence) -> list[Overrides]:
  """One key taking each of `values`: `[{key: v} for v in values]`."""
  if not values:
    raise ValueError(f"sweep.axis({key!r}): no values")
  return [{key: v} for v in values]


def product(*axes: list[Overrides]) -> list[Overrides]:
  """Every combination of the axes (the first varies slowest)."""
  points = []
  for combo in itertools.product(*axes):
    merged: Overrides = {}
    for part in combo:
      clash = sorted(set(merged) & set(part))
      if clash:
        raise ValueError(f"sweep.product: key(s) {clash} appear in more than one axis")
      merged.update(part)
    points.append(merged)
  return points


def zip_(*axes: list[Overrides]) -> list[Overrides]:
  """Axes of equal length, taken together point by point (e.g. a mode and
  the settings that go with it)."""
  lengths = {len(a) for a in axes}
  if len(lengths) > 1:
    raise ValueError(f"sweep.zip_: axes have different lengths {sorted(lengths)}")
  return [{k: v for part in parts for k, v in part.items()} for parts in zip(*axes)]


def name_of(overrides: Overrides) -> str:
  """A readable, unique folder name: `key=value,key=value` (full dotted keys,
  so `learner.lr` and `warmup.lr` never share a workdir)."""
  return ",".join(f"{k}={v}" for k, v in overrides.items()) or "default"


def from_config(config_spec: str) -> list[Overrides]:
  """The sweep of `configs/NAME.py[:ARG]` (or of built-in `NAME[:ARG]`): its
  `get_sweep(ARG)`.

  Raises:
    ValueError: the file has no `get_sweep`, or it returned something other
      than a non-empty list of dicts.
  """
  path, _, arg = config_spec.partition(":")
  if not os.path.isfile(path) and path in builtin.names():
    path = builtin.path(path)
  if not os.path.isfile(path):
    raise ValueError(f"no config file {path!r}; built-in configs: {builtin.names()}")
  spec = importlib.util.spec_from_file_location(f"_sweep_{os.path.basename(path)[:-3]}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  get_sweep = getattr(module, "get_sweep", None)
  if get_sweep is None:
    raise ValueError(f"{path} defines no get_sweep(arg); see arl_jax/config/sweep.py")
  points = get_sweep(arg or None)
  if not points or not all(isinstance(p, dict) for p in points):
    raise ValueError(f"{path}: get_sweep({arg or None!r}) must return a non-empty list of "
                     f"dicts, got {points!r}")
  return points
