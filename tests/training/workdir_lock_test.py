"""One run per workdir: a second one refuses with a message; a dead holder's lock is no obstacle."""

import json
import os
import subprocess
import sys
import time

import pytest

from arl_jax.testing import xla_env
from arl_jax.training import workdir_lock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_second_holder_is_refused_and_told_who_holds_it(tmp_path):
  first = workdir_lock.WorkdirLock(str(tmp_path))
  first.acquire()
  with pytest.raises(workdir_lock.WorkdirInUse, match=rf"is in use by process {os.getpid()} on"):
    workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  first.release()
  with workdir_lock.WorkdirLock(str(tmp_path)) as again:  # free once released
    assert again.previous_holder is None  # the release was clean


def test_the_lock_of_a_killed_process_is_taken_over_and_reported(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from arl_jax.training import workdir_lock; "
       f"workdir_lock.WorkdirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); "
       "time.sleep(60)"], cwd=REPO, stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "held"
  with pytest.raises(workdir_lock.WorkdirInUse, match=f"process {holder.pid}"):
    workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  holder.kill()
  holder.wait()
  lock = workdir_lock.WorkdirLock(str(tmp_path))
  lock.acquire()  # the OS released the dead process's flock
  assert lock.previous_holder["pid"] == holder.pid  # it never cleared its record
  lock.release()


def test_two_runs_on_one_workdir_the_second_refuses(tmp_path):
  workdir = str(tmp_path / "run")
  cmd = [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py:tiny",
         f"--workdir={workdir}", "--config.num_steps=100000", "--config.eval_every=0",
         "--config.warmup.steps=0"]
  env = xla_env.subprocess_env()
  first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=env)
  try:
    deadline = time.monotonic() + 120
    lock_file = os.path.join(workdir, workdir_lock.LOCK_NAME)
    while not (os.path.exists(lock_file) and os.path.getsize(lock_file)):
      assert time.monotonic() < deadline and first.poll() is None, "the first run did not start"
      time.sleep(0.05)
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert second.returncode == 2
    assert f"is in use by process {first.pid}" in second.stderr
    assert "Traceback" not in second.stderr
    assert json.load(open(lock_file))["pid"] == first.pid  # the second run left it alone
  finally:
    first.kill()
    first.wait()
