"""`python -m arl_jax.plot`: PNGs from real run records, runs overlaid, clear errors."""

import os

import pytest

from arl_jax import plot
from arl_jax.testing import tiny
from arl_jax.training import run_lib


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("runs")
  config = tiny.load_config("arith", "tiny")
  config.num_steps = 4
  config.writers = "jsonl,tensorboard"
  config.eval_samples = 4  # (sampled evaluation: pass@k beside the greedy score)
  run_lib.run(config, str(root / "async"), print_fn=lambda *_: None)
  # A second, different run to overlay: the synchronous baseline, greedy only.
  config.eval_samples = 0
  config.orchestrator.update(max_async_level=0, max_off_policy_steps=0)
  config.sampler.weight_update = "drain"
  run_lib.run(config, str(root / "sync"), print_fn=lambda *_: None)
  return [str(root / "async"), str(root / "sync")]


def test_every_figure_is_a_non_empty_png(two_runs, tmp_path):
  paths = plot.plot_all(two_runs, str(tmp_path / "plots"))
  assert [os.path.basename(p) for p in paths] == [f"{name}.png" for name in plot.FIGURES]
  for path in paths:
    with open(path, "rb") as f:
      data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, path
  run = plot.Run(two_runs[0])
  assert run.label == "async" and len(run.steps) == 4
  rl = [e for e in run.evals if e["phase"] == "rl"]
  assert [e["step"] for e in rl if "eval_reward" in e] == [0, 2, 4]
  # The sampled pass of step 0 (nothing published yet) shares its greedy row;
  # those of versions 2 and 4 ran beside training and have rows of their own.
  assert [e["step"] for e in rl if "eval_pass_at_k" in e] == [0, 2, 4]
  assert [e["step"] for e in rl if "eval_sampled_s" in e] == [2, 4]
  assert all("rl_wall_s" in e for e in rl)
  for e in (e for e in run.evals if "eval_pass_at_k" in e):
    assert sorted(e["eval_pass_at_k"]) == ["1", "2", "4"] and e["eval_samples"] == 4
    assert e["eval_pass_at_k"]["1"] <= e["eval_pass_at_k"]["2"] <= e["eval_pass_at_k"]["4"]
    assert set(e["eval_sampled_by_env"]) == {"arith"}
  assert not any("eval_pass_at_k" in e for e in plot.Run(two_runs[1]).evals)


def test_the_cli_writes_next_to_the_run_and_names_bad_input(two_runs, tmp_path, capsys):
  plot.main([two_runs[0]])
  assert os.path.isfile(os.path.join(two_runs[0], "plots", "reward.png"))
  assert "reward.png" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="no metrics.jsonl"):
    plot.main([str(tmp_path)])
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "metrics.jsonl").write_text('{"phase": "rl"}\nnot json\n')
  with pytest.raises(SystemExit, match=r"metrics.jsonl:2: not JSON"):
    plot.main([str(bad)])


def test_tensorboard_event_files_hold_the_metrics(two_runs):
  from tensorboard.backend.event_processing import event_accumulator
  logdir = os.path.join(two_runs[0], "tensorboard")
  acc = event_accumulator.EventAccumulator(logdir)
  acc.Reload()
  tags = acc.Tags()["scalars"]
  assert {"rl/reward_mean", "rl/lag_mean", "rl/loss", "eval/eval_reward",
          "eval/eval_pass_at_k/4", "warmup/loss", "rl/lr"} <= set(tags)
  assert [e.step for e in acc.Scalars("rl/loss")] == [0, 1, 2, 3]
  assert any(t.startswith("rl/lag_histogram/") for t in tags)  # nested dicts flattened
