"""The sampled evaluation beside training (`training/sampled_eval.py`): the
learner goes on updating while it runs, its result is the one a synchronous
pass over the same published params gives, the next one waits for it, an
error in it is the run's, and a checkpoint holds its row."""

import json
import shutil
import threading
import time

import pytest

from arl_jax.testing import tiny
from arl_jax.training import evaluation, run_lib, sampled_eval


def _rows(workdir):
  with open(f"{workdir}/metrics.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _positions(rows):
  """`{(step, kind): index}` of the RL rows: greedy evaluations, sampled
  ones written on their own, updates."""
  kinds = {"greedy": lambda r: "eval_reward" in r and "reward_mean" not in r,
           "sampled": lambda r: "eval_sampled_s" in r, "update": lambda r: "reward_mean" in r}
  return {(r["step"], kind): i for i, r in enumerate(rows) for kind, is_kind in kinds.items()
          if is_kind(r)}


def test_training_goes_on_while_a_slow_sampled_evaluation_runs(tmp_path, monkeypatch):
  """Each sampled pass of a published version takes >= 2 s more here: the
  updates after it are trained before its row is written (a checkpoint of
  its version does not wait for it either), its numbers equal a synchronous
  pass over the params it was given (the same keyed draws), and a resume
  from that checkpoint evaluates it again: one row each, none lost."""
  passes = []  # (params, evaluator, result) of every pass beside training
  original = evaluation.Evaluator.sampled

  def slow_sampled(self, params):
    result = original(self, params)
    if threading.current_thread() is not threading.main_thread():
      time.sleep(2.0)
      passes.append((params, self, result))
    return result

  monkeypatch.setattr(evaluation.Evaluator, "sampled", slow_sampled)
  config = tiny.load_config("arith", "tiny")
  config.update(num_steps=8, eval_every=4, eval_samples=4)
  config.warmup.steps = 0
  config.checkpoint = {"every_steps": 4, "keep": 3}
  run_lib.run(config, str(tmp_path), print_fn=lambda *_: None)
  rows = [r for r in _rows(tmp_path) if r.get("phase") == "rl"]
  position = _positions(rows)
  assert sorted(s for s, k in position if k == "sampled") == [4, 8]
  # Version 4's pass: later updates finished while it ran (on the RL clock).
  sampled_4 = rows[position[(4, "sampled")]]
  assert sampled_4["eval_sampled_s"] >= 2.0 and "eval_sampled_wait_s" in sampled_4
  ran = (sampled_4["rl_wall_s"] - sampled_4["eval_sampled_s"], sampled_4["rl_wall_s"])
  during = [r["version"] for r in rows if "reward_mean" in r and ran[0] < r["wall_s"] < ran[1]]
  assert during and min(during) > 4, (ran, [(r["version"], r["wall_s"]) for r in rows
                                           if "reward_mean" in r])
  params, evaluator, result = passes[0]
  again = original(evaluator, params)
  assert sampled_4["eval_avg_at_n"] == result["avg_at_n"] == again["avg_at_n"]
  assert sampled_4["eval_pass_at_k"] == {str(k): v for k, v in again["pass_at_k"].items()}
  # The progress line of the update after its row carries its pass@4.
  after = next(r for r in rows[position[(4, "sampled")] + 1:] if "reward_mean" in r)
  assert after["eval_pass_at_k"] == sampled_4["eval_pass_at_k"]
  # The checkpoint of version 4 noted the pass still running; from it, a resume
  # evaluates it again, and the row written after the checkpoint is set aside.
  with open(tmp_path / "checkpoints" / "4" / "run" / "metadata", encoding="utf-8") as f:
    assert json.load(f)["sampled_eval_pending"] == 4
  shutil.rmtree(tmp_path / "checkpoints" / "8")
  lines = []
  run_lib.run(config, str(tmp_path), print_fn=lines.append)
  assert any("sampled evaluation of step 4 was running at the checkpoint" in line
             for line in lines)
  rows = [r for r in _rows(tmp_path) if r.get("phase") == "rl"]
  assert sorted(r["step"] for r in rows if "eval_sampled_s" in r) == [4, 8]
  assert sorted(r["step"] for r in rows if "reward_mean" in r) == list(range(8))


def test_one_at_a_time_in_order_and_errors_reach_the_caller():
  calls = []

  def fn(params):
    calls.append(("start", params))
    time.sleep(0.2)
    if params == "bad":
      raise ValueError("broken environment")
    calls.append(("end", params))
    return {"params": params}

  runner = sampled_eval.BackgroundSampledEval(fn)
  runner.submit("a", 1, "rl")
  assert runner.running_step == 1
  runner.submit("b", 2, "rl")  # waits for a
  runner.wait()
  assert calls == [("start", "a"), ("end", "a"), ("start", "b"), ("end", "b")]
  done = runner.collect()
  assert [(d.step, d.result["params"]) for d in done] == [(1, "a"), (2, "b")]
  assert done[0].waited == 0.0 and done[1].waited > 0.1 and done[0].seconds >= 0.2
  assert runner.collect() == [] and runner.running_step is None
  runner.submit("bad", 3, "rl")
  runner.wait()
  with pytest.raises(RuntimeError, match="the sampled evaluation failed") as info:
    runner.collect()
  assert isinstance(info.value.__cause__, ValueError)
