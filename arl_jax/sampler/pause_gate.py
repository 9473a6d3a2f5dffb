"""`PauseGate`: lets a caller hold a worker thread between two of its steps.

A checkpoint must see the sampler's slots and the dispatcher's open work at
one instant. The caller closes the gate and waits until the worker thread,
at its next step boundary, acknowledges and stops; the worker waits there
until the caller opens the gate again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable


class PauseGate:
  """A gate one caller at a time may hold closed; the worker calls `serve`."""

  def __init__(self):
    self._lock = threading.Lock()  # one holder at a time
    self._requested = threading.Event()
    self._paused = threading.Event()
    self._release = threading.Event()

  @property
  def is_paused(self) -> bool:
    """Whether the worker is waiting at the gate."""
    return self._paused.is_set()

  @property
  def requested(self) -> bool:
    """Whether a caller waits for the worker to reach the gate."""
    return self._requested.is_set()

  def serve(self, on_pause_fn=None) -> bool:
    """Called by the worker between two steps: waits while the gate is held.
    Returns whether it did (a caller held it); `on_pause_fn` is called
    first, before the caller goes on."""
    if not self._requested.is_set():  # the common case: one flag read per step
      return False
    if on_pause_fn is not None:
      on_pause_fn()
    self._paused.set()
    self._release.wait()
    return True

  def open(self) -> None:
    """Releases a waiting worker for good (it is stopping)."""
    self._release.set()

  @contextlib.contextmanager
  def hold(self, thread: threading.Thread | None, *, timeout_s: float,
           check_fn: Callable[[], None]):
    """Holds `thread` at its gate for the `with` block (at once when it is not
    running).

    Args:
      thread: the worker thread (None: not started).
      timeout_s: how long to wait for the worker to reach the gate.
      check_fn: called while waiting; raises if the worker failed.

    Raises:
      RuntimeError: the worker ended or did not reach the gate in time.
    """
    with self._lock:
      running = thread is not None and thread.is_alive()
      if running:
        self._release.clear()
        self._requested.set()
        deadline = time.monotonic() + timeout_s
        while not self._paused.wait(0.1):
          check_fn()
          if not thread.is_alive() or time.monotonic() > deadline:
            self._requested.clear()
            self._release.set()
            raise RuntimeError("the sampler engine did not pause for a checkpoint snapshot")
      try:
        yield
      finally:
        if running:
          self._requested.clear()
          self._paused.clear()
          self._release.set()
