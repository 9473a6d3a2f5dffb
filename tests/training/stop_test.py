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
