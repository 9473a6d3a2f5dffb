"""SIGKILL a run at several points, resume it, and audit its records: every
prompt trained at most once along the surviving lineage, versions continuous,
and nothing unfinished at a checkpoint lost."""

import collections
import json
import os
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp

from arl_jax.testing import xla_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, GROUPS_PER_BATCH = 10, 8


def _command(workdir):
  return [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py:tiny",
          f"--workdir={workdir}", f"--config.num_steps={STEPS}", "--config.eval_every=0",
          "--config.checkpoint.every_steps=2", "--config.checkpoint.save_final=True",
          # ~860 training prompts: one epoch covers the whole test, so a repeat is a bug.
          "--config.env.max_operand=30", "--config.sampler.prompt_len=8",
          "--config.orchestrator.max_async_level=2"]


def _events(workdir):
  path = os.path.join(workdir, "groups.jsonl")
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  events = []
  for line in lines:
    try:
      events.append(json.loads(line))
    except json.JSONDecodeError:  # the line being written when the process died
      pass
  return events


def _max_trained(workdir) -> int:
  return max((e["version"] for e in _events(workdir) if e["event"] == "trained"), default=0)


def _run_until(workdir, condition, timeout=120.0) -> int:
  """Starts the run and SIGKILLs it once `condition()` holds; returns its exit code."""
  proc = subprocess.Popen(_command(workdir), cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, env=xla_env.subprocess_env())
  deadline = time.monotonic() + timeout
  while proc.poll() is None and time.monotonic() < deadline:
    if condition():
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.02)
  return proc.wait(timeout=timeout)


def _saving(workdir) -> bool:
  """An orbax save is in progress (its temporary folder exists)."""
  root = os.path.join(workdir, "checkpoints")
  return os.path.isdir(root) and any("tmp" in name for name in os.listdir(root))


def _saved(workdir) -> set[int]:
  """Versions of the finished checkpoints (orbax renames a save's folder to
  its step when it is complete)."""
  root = os.path.join(workdir, "checkpoints")
  return {int(n) for n in os.listdir(root) if n.isdigit()} if os.path.isdir(root) else set()


def test_killed_runs_resume_without_losing_or_repeating_prompts(tmp_path):
  workdir = str(tmp_path)
  # Kill 1: mid-run, past version 3, once the checkpoint of version 2 is complete.
  assert _run_until(workdir, lambda: 2 in _saved(workdir) and _max_trained(workdir) >= 3) == \
      -signal.SIGKILL
  # Kill 2: while a later checkpoint is being written (or, if none is caught, past 7).
  first = max(_saved(workdir))
  assert _run_until(workdir, lambda: (_saving(workdir) and max(_saved(workdir)) > first)
                    or _max_trained(workdir) >= 7) in (-signal.SIGKILL, 0)
  # The last run finishes.
  assert _run_until(workdir, lambda: False) == 0

  # A resume sets aside the events written after its checkpoint
  # (`training/records.py`): groups.jsonl is the surviving lineage itself.
  events = _events(workdir)
  resumes = [e["version"] for e in events if e["event"] == "resumed"]
  lineage = [e for e in events if e["event"] != "resumed"]
  assert len(resumes) == 2 and resumes[0] >= 2
  terminal = collections.Counter(e["group_id"] for e in lineage)
  assert max(terminal.values()) == 1, "a group has two terminal records"
  trained = [e for e in lineage if e["event"] == "trained"]
  versions = sorted({e["version"] for e in trained})
  assert versions == list(range(1, STEPS + 1))
  for v in versions:
    assert sum(e["version"] == v for e in trained) == GROUPS_PER_BATCH
  prompts = [e["prompt_id"] for e in trained]
  assert len(prompts) == len(set(prompts)), "a prompt was trained twice"
  retired = {e["prompt_id"] for e in lineage}
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                  item_names=("state", "run"))
  assert manager.latest_step() == STEPS
  for version in resumes:
    if version not in manager.all_steps():
      continue  # deleted by keep=3; the last resumes are kept
    record = manager.restore(version, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
    unfinished = {g["prompt"]["prompt_id"] for g in record["work"]["groups"]}
    assert unfinished <= retired, "work unfinished at a checkpoint was lost"


def test_sigterm_stops_after_the_update_and_saves_it(tmp_path):
  """A preemption notice (SIGTERM) ends the run cleanly with a checkpoint of
  the last update, so nothing since the previous periodic save is redone."""
  workdir = str(tmp_path)
  cmd = [*_command(workdir), "--config.checkpoint.every_steps=0",
         "--config.num_steps=1000"]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=xla_env.subprocess_env())
  deadline = time.monotonic() + 120
  while _max_trained(workdir) < 2 and time.monotonic() < deadline and proc.poll() is None:
    time.sleep(0.02)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  # Not 0: a scheduler must not record a preempted job as succeeded.
  assert proc.returncode == 75, out[-2000:]  # arl_jax.launch.EXIT_STOPPED
  assert "stopping after" in out and "signal SIGTERM" in out
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"),
                                  item_names=("state", "run"))
  assert manager.latest_step() == _max_trained(workdir) >= 2
  assert out.strip().splitlines()[-1] == (
      f"stopped at version {manager.latest_step()} of 1000 (signal SIGTERM): resumable: the "
      f"same command with --workdir={workdir} resumes from the checkpoint of version "
      f"{manager.latest_step()}")
  # The rerun resumes and, run to the end, exits 0.
  proc = subprocess.run([*cmd[:-1], f"--config.num_steps={manager.latest_step() + 1}"],
                        cwd=REPO, capture_output=True, text=True, env=xla_env.subprocess_env(),
                        timeout=180)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert f"at version {manager.latest_step()}: " in proc.stdout, proc.stdout[-2000:]
