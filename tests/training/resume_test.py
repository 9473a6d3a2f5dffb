"""Resuming: the newest intact checkpoint wins (damaged ones are skipped, named and set
aside), the records follow it, and a changed config is reported."""

import collections
import glob
import json
import os

import pytest

from arl_jax.learner import checkpointing
from arl_jax.testing import tiny
from arl_jax.training import run_lib


def _config(num_steps):
  config = tiny.load_config("arith", "tiny")
  config.num_steps = num_steps
  config.eval_every = 0
  config.warmup.steps = 0
  config.checkpoint = {"every_steps": 2, "keep": 3}
  config.env.max_operand = 30  # one epoch of prompts covers the test: a repeat is a bug
  config.sampler.prompt_len = 8
  return config


def _run(workdir, config):
  lines = []
  result = run_lib.run(config, str(workdir), print_fn=lines.append)
  return result, lines


def _rows(workdir, name="metrics.jsonl"):
  return [json.loads(line) for line in open(os.path.join(workdir, name))]


def _check_records(workdir, num_steps, groups_per_batch=8):
  """Each update has one row; each group one terminal event; no prompt trained twice."""
  steps = [r["step"] for r in _rows(workdir) if r.get("phase") == "rl" and "loss" in r]
  assert steps == list(range(num_steps))
  events = [e for e in _rows(workdir, "groups.jsonl") if e["event"] != "resumed"]
  assert max(collections.Counter(e["group_id"] for e in events).values()) == 1
  trained = [e for e in events if e["event"] == "trained"]
  assert collections.Counter(e["version"] for e in trained) == {
      v: groups_per_batch for v in range(1, num_steps + 1)}
  prompts = [e["prompt_id"] for e in trained]
  assert len(prompts) == len(set(prompts))


def _biggest_file(step_dir):
  files = [f for f in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True)
           if os.path.isfile(f)]
  return max(files, key=os.path.getsize)


def test_damaged_checkpoints_are_skipped_and_the_records_follow(tmp_path):
  root = tmp_path / "checkpoints"
  _run(tmp_path, _config(6))  # checkpoints 2, 4, 6
  # A truncated array file in the newest step: resume from 4, redo 5 and 6.
  path = _biggest_file(root / "6")
  os.truncate(path, os.path.getsize(path) // 2)
  config = _config(8)
  config.env.num_workers = 3  # (an environment setting that changed)
  result, lines = _run(tmp_path, config)
  assert result.final_version == 8
  text = "\n".join(lines)
  assert "warning: skipped checkpoint step 6:" in text and "/6/state cannot be restored" in text
  assert "resumed from" in text and "at version 4" in text
  assert "env.num_workers: 2 -> 3" in text  # the changed config is reported
  assert "set aside records" in text and "metrics.jsonl" in text
  assert len(os.listdir(str(root) + "_skipped")) == 1  # kept for inspection
  _check_records(tmp_path, 8)

  # A missing _METADATA: a "pytree structure" error before; now a skipped step.
  os.remove(root / "8" / "state" / "_METADATA")
  result, lines = _run(tmp_path, _config(10))
  text = "\n".join(lines)
  assert "skipped checkpoint step 8:" in text and "_METADATA is missing" in text
  assert "at version 6" in text and result.final_version == 10
  _check_records(tmp_path, 10)

  # A torn run record: named, skipped.
  with open(root / "10" / "run" / "metadata", "w") as f:
    f.write('{"format_version": 3, "vers')
  result, lines = _run(tmp_path, _config(12))
  text = "\n".join(lines)
  assert "skipped checkpoint step 10:" in text and "/10/run: the run record cannot be read" in text
  assert "at version 8" in text and result.final_version == 12
  _check_records(tmp_path, 12)


def test_when_no_checkpoint_reads_the_error_lists_every_step(tmp_path):
  _run(tmp_path, _config(4))  # checkpoints 2, 4
  for step in (2, 4):
    with open(tmp_path / "checkpoints" / str(step) / "run" / "metadata", "w") as f:
      json.dump({"format_version": checkpointing.FORMAT_VERSION, "version": step}, f)
  with pytest.raises(checkpointing.CheckpointFormatError) as e:
    _run(tmp_path, _config(6))
  assert "step 4:" in str(e.value) and "step 2:" in str(e.value)
  assert "work is missing" in str(e.value)


def test_the_adaptive_staleness_bound_is_logged_saved_and_resumed(tmp_path):
  def config(num_steps):
    config = _config(num_steps)
    config.orchestrator.max_off_policy_steps = 4
    config.orchestrator.staleness.update(policy="adaptive", k_min=1, k_max=4, min_tokens=1)
    return config
  _run(tmp_path, config(2))
  with open(tmp_path / "checkpoints" / "2" / "run" / "metadata") as f:
    saved = json.load(f)["staleness"]
  # As it stood after the statistics of the update that made version 2.
  assert (saved["policy"], saved["applied_version"], saved["applied_k"]) == ("adaptive", 2, 4)
  assert saved["averages"]  # (lag 1 was measured: the tiny run trains one version behind)
  result, _ = _run(tmp_path, config(4))
  assert result.final_version == 4
  rows = [r for r in _rows(tmp_path) if r.get("phase") == "rl" and "loss" in r]
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  for r in rows:
    assert r["staleness_k"] == 4 and "ess_lag1" in r  # (tiny ratios are 1: nothing fails)
    assert {"staleness_k_next", "staleness_k_action", "staleness_k_stat",
            "staleness_k_lag"} <= set(r)
  _check_records(tmp_path, 4)
