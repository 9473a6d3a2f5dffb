"""Metric sinks: records fan out to every configured writer."""

import importlib.machinery
import sys
import types

import pytest

from arl_jax.config import run_spec
from arl_jax.metrics import writer as writer_lib
from arl_jax.testing import tiny


class FakeWandb(types.ModuleType):
  """Stands in for `wandb` (not installed here): records what the writer calls."""

  def __init__(self):
    super().__init__("wandb")
    self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    self.logged, self.inits, self.finished = [], [], False

  def init(self, **kwargs):
    self.inits.append(kwargs)
    return self

  def log(self, values, step=None):
    self.logged.append((step, values))

  def finish(self):
    self.finished = True


def test_wandb_gets_every_number_by_phase_and_step(monkeypatch, tmp_path):
  fake = FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  monkeypatch.setenv("WANDB_PROJECT", "lag_study")
  writer = writer_lib.make_writer(str(tmp_path / "run1"), ("jsonl", "wandb"),
                                  run_config={"seed": 3})
  writer.write({"phase": "rl", "step": 5, "reward_mean": 0.5, "lag_histogram": {"1": 8},
                "note": "text is skipped"})
  writer.write({"phase": "rl", "step": 6, "eval_reward": 0.25})  # an evaluation
  writer.write({"phase": "data", "skipped_lines": 2})  # no step: not plotted
  writer.close()
  assert fake.inits == [{"project": "lag_study", "dir": str(tmp_path / "run1"), "name": "run1",
                         "config": {"seed": 3}}]
  assert fake.logged == [(5, {"rl/reward_mean": 0.5, "rl/lag_histogram/1": 8.0}),
                         (None, {"eval/eval_reward": 0.25})]
  assert fake.finished
  lines = (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 3  # JSON lines always get everything


def test_a_writer_whose_package_is_missing_is_a_config_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
  monkeypatch.setattr(writer_lib.importlib.util, "find_spec",
                      lambda name: None if name == "wandb" else object())
  config = tiny.load_config("arith", "tiny")
  config.writers = "jsonl,wandb"
  with pytest.raises(run_spec.ConfigError, match="config.writers: .*pip install wandb"):
    run_spec.build(config)
  config.writers = "jsonl,csv"
  with pytest.raises(run_spec.ConfigError, match=r"unknown writer\(s\) \['csv'\]"):
    run_spec.build(config)
