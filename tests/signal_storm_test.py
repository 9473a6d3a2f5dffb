"""A signal storm: SIGINT and SIGTERM at moments of warm-up, RL steps and saves, several
rounds, resuming each time. Every round must end cleanly, and the records must audit:
every prompt trained once, every group one terminal record, every update one row."""

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp

from arl_jax.testing import xla_env
from tests import kill_resume_test

REPO = kill_resume_test.REPO
STEPS, GROUPS_PER_BATCH, WARMUP = 12, 8, 60


def _command(workdir):
  return [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py:tiny",
          f"--workdir={workdir}", f"--config.num_steps={STEPS}", "--config.eval_every=4",
          "--config.checkpoint.every_steps=1", "--config.checkpoint.save_final=True",
          f"--config.warmup.steps={WARMUP}", "--config.warmup.batch_size=8",
          # ~860 training prompts: one epoch covers the test, so a repeat is a bug.
          "--config.env.max_operand=30", "--config.sampler.prompt_len=8",
          "--config.orchestrator.max_async_level=2"]


def _rows(workdir, name):
  path = os.path.join(workdir, name)
  if not os.path.exists(path):
    return []
  rows = []
  for line in open(path, encoding="utf-8").read().splitlines():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:  # a line being written
      pass
  return rows


def _trained(workdir) -> int:
  return max((e["version"] for e in _rows(workdir, "groups.jsonl") if e["event"] == "trained"),
             default=0)


def _warming_up(workdir) -> bool:
  return any(r.get("phase") == "warmup" and "loss" in r for r in _rows(workdir, "metrics.jsonl"))


def _started(workdir) -> bool:
  lock = os.path.join(workdir, ".lock")
  return os.path.exists(lock) and os.path.getsize(lock) > 0


STOPPED = 75  # arl_jax.launch.EXIT_STOPPED (importing launch here would define its flags)


def _round(workdir, trigger, signals, rng) -> str:
  """Starts the run, waits for `trigger()`, sends `signals` (a short random
  pause between them) and returns the run's output; the run must end cleanly,
  with status 0 only if it ran to the end (a stopped run exits STOPPED, its
  last line saying where a rerun starts)."""
  proc = subprocess.Popen(_command(workdir), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=xla_env.subprocess_env())
  deadline = time.monotonic() + 240
  while proc.poll() is None and not trigger():
    assert time.monotonic() < deadline, "the trigger never came"
    time.sleep(0.01)
  for signum in signals:
    if proc.poll() is None:
      proc.send_signal(signum)
      time.sleep(rng.uniform(0.0, 0.3))
  out, _ = proc.communicate(timeout=240)
  assert "Traceback" not in out, out[-3000:]
  last = out.strip().splitlines()[-1]
  if f"done: {STEPS} updates" in out:
    assert proc.returncode == 0, out[-3000:]
  else:
    assert proc.returncode == STOPPED, out[-3000:]
    assert last.startswith("stopped at version ") and f" of {STEPS} (signal SIG" in last, last
    saved = max(kill_resume_test._saved(workdir), default=None)
    assert (f"resumes from the checkpoint of version {saved}" in last if saved is not None
            else "the same command starts over" in last), last
  return out


def test_a_signal_storm_loses_nothing_and_repeats_nothing(tmp_path):
  workdir = str(tmp_path)
  rng = random.Random(0)
  ckpts = lambda: kill_resume_test._saved(workdir)  # noqa: E731
  outputs = []
  # During warm-up (nothing saved yet: the rerun starts over).
  outputs.append(_round(workdir, lambda: _warming_up(workdir), [signal.SIGTERM], rng))
  assert "stopping during the warm-up" in outputs[-1]
  # While the run is still being built (restore, compile): before any update.
  outputs.append(_round(workdir, lambda: _started(workdir), [signal.SIGINT], rng))
  # Between RL steps: a preemption notice followed by an impatient Ctrl-C.
  target = _trained(workdir) + rng.randint(1, 2)
  outputs.append(_round(workdir, lambda: _trained(workdir) >= target,
                        [signal.SIGTERM, signal.SIGINT], rng))
  # While a periodic checkpoint is being written (or, if none is caught, at the next update).
  seen = max(ckpts(), default=0)
  outputs.append(_round(workdir, lambda: kill_resume_test._saving(workdir) and max(
      ckpts(), default=0) >= seen or _trained(workdir) > seen + 1,
      [signal.SIGINT, signal.SIGINT], rng))
  # The last round runs to the end.
  outputs.append(_round(workdir, lambda: False, [], rng))
  assert "done: 12 updates" in outputs[-1]
  assert sum(f"done: {STEPS} updates" not in out for out in outputs) == 4  # (each exited 75)
  assert sum("resumed from" in out for out in outputs) >= 2

  # metrics.jsonl: each update once, each evaluation once, the warm-up once.
  rows = _rows(workdir, "metrics.jsonl")
  rl = [r["step"] for r in rows if r.get("phase") == "rl" and "loss" in r]
  assert rl == list(range(STEPS))
  evals = [(r["phase"], r["step"]) for r in rows if "eval_reward" in r and "loss" not in r]
  assert len(evals) == len(set(evals)) and ("rl", STEPS) in evals
  warmup = [r["step"] for r in rows if r.get("phase") == "warmup" and "loss" in r]
  assert warmup == sorted(set(warmup)) and warmup[-1] == WARMUP - 1
  # The interrupted warm-up's rows were set aside, not deleted.
  assert any(r.get("phase") == "warmup" for r in _rows(workdir, "metrics.superseded.jsonl"))

  # groups.jsonl: one terminal record per group, each prompt trained once.
  events = [e for e in _rows(workdir, "groups.jsonl") if e["event"] != "resumed"]
  terminal = collections.Counter(e["group_id"] for e in events)
  assert max(terminal.values()) == 1, "a group has two terminal records"
  trained = [e for e in events if e["event"] == "trained"]
  assert collections.Counter(e["version"] for e in trained) == {
      v: GROUPS_PER_BATCH for v in range(1, STEPS + 1)}
  prompts = [e["prompt_id"] for e in trained]
  assert len(prompts) == len(set(prompts)), "a prompt was trained twice"

  # Nothing lost: every group ever dispatched was retired or is open in the last checkpoint.
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                  item_names=("state", "run"))
  assert manager.latest_step() == STEPS
  record = manager.restore(STEPS, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
  open_groups = {g["group_id"] for g in record["work"]["groups"]}
  assert not open_groups & set(terminal)
  assert open_groups | set(terminal) == set(range(record["work"]["next_group_id"]))
