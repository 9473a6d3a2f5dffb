"""Stop requests: SIGINT (Ctrl-C) and SIGTERM (a preemption notice) become a flag.

A signal never interrupts the run where it happens to be (a KeyboardInterrupt
raised between the donating update and its result, or inside an orbax save,
or between two lines of `groups.jsonl`, loses or repeats work). Instead the
handler records the request and the run stops at its next safe point: between
two warm-up steps, between two updates, or while it waits for a batch. Then it
goes through one stop sequence (`learner_loop.py`) whatever the signal and
whenever it came.

Further signals while stopping do not cut the sequence short; they print what
the run is doing and how to stop it at once (SIGKILL, after which the run
resumes from its last complete checkpoint).
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
  """Truthy once a stop was asked for (a signal, or `request`).

  Use as a context manager around the run: it installs the handlers (only in
  the main thread, where Python delivers signals) and puts the previous ones
  back on exit.
  """

  def __init__(self, *, decides: bool = True):
    """Args:
      decides: this process decides when the run stops. False for the
        followers of a multi-controller run: process 0 decides for them, so
        a signal here is reported and otherwise ignored.
    """
    self.reason = ""
    self.phase = "starting"  # what the run is doing, for the repeated-signal message
    self.decides = decides
    self._previous: dict[int, object] = {}

  def __enter__(self) -> StopRequest:
    if threading.current_thread() is threading.main_thread():
      for signum in SIGNALS:
        self._previous[signum] = signal.signal(signum, self._on_signal)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def __bool__(self) -> bool:
    return bool(self.reason)

  def request(self, reason: str) -> None:
    """Asks the run to stop at its next safe point (the first reason wins)."""
    self.reason = self.reason or reason

  def _on_signal(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if not self.decides:
      _say(f"{name} ignored: process 0 decides when a multi-controller run stops\n")
    elif not self.reason:
      self.reason = f"signal {name}" + (" (Ctrl-C)" if signum == signal.SIGINT else "")
    else:
      _say(f"{name}: already stopping ({self.phase}); kill -9 {os.getpid()} stops at once "
           "(a rerun resumes from the last complete checkpoint)\n")


def _say(text: str) -> None:
  # Straight to the file descriptor: a handler runs between two bytecodes of
  # the main thread, which may be inside `print` (a buffered write would
  # raise "reentrant call" there).
  try:
    os.write(2, text.encode())
  except OSError:
    pass
