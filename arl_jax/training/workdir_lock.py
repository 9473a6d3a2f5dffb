"""One run per workdir: an exclusive lock on `<workdir>/.lock` for the run's lifetime.

Two runs on one workdir would both resume from its checkpoint, train every
group twice and interleave their metrics. The lock is an advisory `flock` on
the file, which the operating system releases when the holding process ends
however it ends (SIGKILL included), so a lock left by a dead process never
blocks a rerun. The file's text (pid, host, start time) tells the user who
holds it; a clean release empties it, so text found by `acquire` means the
previous run ended without one (killed or crashed): `previous_holder`.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

LOCK_NAME = ".lock"


class WorkdirInUse(RuntimeError):
  """Another live process holds the workdir."""


class WorkdirLock:
  """Holds `<workdir>/.lock` from `acquire` to `release` (or the end of the process)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_NAME)
    self._fd: int | None = None
    # What a previous holder wrote and never cleared: it did not stop cleanly.
    self.previous_holder: dict | None = None

  def acquire(self) -> None:
    """Takes the lock.

    Raises:
      WorkdirInUse: another process holds it (the message says which).
    """
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read(fd)
      os.close(fd)
      who = (f"process {holder.get('pid')} on {holder.get('host')}, running since "
             f"{holder.get('started')}" if holder else "another process")
      raise WorkdirInUse(
          f"workdir {os.path.dirname(self.path)} is in use by {who} (lock {self.path}); "
          "wait for that run to end or stop it, or choose another --workdir") from None
    self.previous_holder = _read(fd) or None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    self._fd = fd

  def release(self) -> None:
    if self._fd is not None:
      os.ftruncate(self._fd, 0)  # a clean end
      os.close(self._fd)  # (closing the descriptor releases the flock)
      self._fd = None

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()


def _read(fd: int) -> dict:
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    return json.loads(os.read(fd, 4096) or b"{}")
  except (OSError, ValueError):
    return {}
