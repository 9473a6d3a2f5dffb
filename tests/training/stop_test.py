"""Signals become a stop request; they never raise into the run."""

import os
import signal
import threading

import pytest

from arl_jax.training import stop as stop_lib


@pytest.fixture(autouse=True)
def _main_thread():
  # Handlers exist only in the main thread; elsewhere these signals would
  # interrupt (or kill) the test process itself.
  assert threading.current_thread() is threading.main_thread()


def test_a_signal_sets_the_request_and_the_handlers_come_back():
  before = signal.getsignal(signal.SIGINT)
  with stop_lib.StopRequest() as stop:
    assert not stop
    os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
    assert stop and "SIGINT" in stop.reason
    os.kill(os.getpid(), signal.SIGTERM)  # a second one does not change the reason
    assert "SIGINT" in stop.reason
  assert signal.getsignal(signal.SIGINT) is before


def test_a_repeated_signal_says_what_the_run_is_doing(capfd):
  with stop_lib.StopRequest() as stop:
    stop.phase = "saving the final checkpoint"
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
  err = capfd.readouterr().err
  assert "already stopping (saving the final checkpoint)" in err
  assert f"kill -9 {os.getpid()}" in err


def test_a_follower_ignores_signals(capfd):
  with stop_lib.StopRequest(decides=False) as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    assert not stop
  assert "process 0 decides" in capfd.readouterr().err


def test_a_run_stopped_after_its_warm_up_saves_version_0_and_resumes_without_warming_up(
    tmp_path):
  """The stop arrives once the warm-up is done but before the first update:
  the run is incomplete (launch exits 75), version 0 (the warmed-up params)
  is saved, and a rerun resumes from it instead of warming up again."""
  from arl_jax.testing import tiny  # noqa: PLC0415
  from arl_jax.training import run_lib  # noqa: PLC0415

  config = tiny.load_config("arith", "tiny")
  config.checkpoint.save_final = True
  config.warmup.steps = 3
  request = stop_lib.StopRequest()
  lines = []

  def print_fn(line):
    lines.append(line)
    if line.startswith("eval [rl step 0]"):  # (after the warm-up, before any update)
      request.request("test stop")

  result = run_lib.run(config, str(tmp_path), print_fn=print_fn, stop=request)
  assert (result.complete, result.final_version, result.saved_version) == (False, 0, 0)
  assert result.stop_reason == "test stop"
  assert lines[-1] == (f"stopped at version 0 of 4 (test stop): resumable: the same command "
                       f"with --workdir={tmp_path} resumes from the checkpoint of version 0")
  lines.clear()
  result = run_lib.run(config, str(tmp_path), print_fn=lines.append)
  assert result.complete and result.final_version == 4
  assert any(line.startswith("resumed from") for line in lines)
  assert not any(line.startswith("warmup") for line in lines), lines
