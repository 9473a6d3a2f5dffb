"""Calls of a function on hostile input in child processes, each bounded.

A model's answer is hostile input: `2^{2^{2^{20}}}` makes sympy compute
forever, and a library's own timeout (a SIGALRM, as math-verify's) works
only in the main thread and would take the process's alarm signal from
everyone else. So a checker that may not return runs here: in a spawned
child (no JAX, no threads of the run) under an address-space cap, with a
wall timeout after which the child is killed and replaced. A child is a new
interpreter running this module (`python -m`), not a fork or a
multiprocessing spawn, which would import the run's own main module again.
A reply is read up to 1 MiB; a child that writes more is killed. This bounds
a library call on hostile text; it is not a sandbox for code a model wrote
(no network or file isolation). Children are
reused between calls (importing sympy costs a second); a pool holds up to
`workers` of them and callers from many threads share it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time


@dataclasses.dataclass(frozen=True)
class Outcome:
  """Attributes:
    ok: the function returned (`value` holds what it returned).
    value: its result when `ok`.
    reason: why not, otherwise (`timeout`, `exception: ...`, `child died: ...`).
  """

  ok: bool
  value: object = None
  reason: str = ""


def _serve(function: str, memory_bytes: int) -> None:
  """A child's loop (`python -m arl_jax.envs.child_calls FUNCTION MEMORY`):
  `function(*args)` for each JSON line of arguments on stdin, one JSON line
  `[kind, value]` back on stdout, until stdin closes."""
  import resource  # noqa: PLC0415

  if memory_bytes:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
  out = sys.stdout
  sys.stdout = sys.stderr  # (whatever the function prints must not break the protocol)
  module, _, name = function.partition(":")
  fn = getattr(importlib.import_module(module), name)

  def reply(kind, value) -> None:
    out.write(json.dumps([kind, value]) + "\n")
    out.flush()

  reply("ready", None)
  for line in sys.stdin:
    try:
      reply("ok", fn(*json.loads(line)))
    except MemoryError:
      reply("error", "exception: MemoryError (over the child's memory cap)")
    except Exception as e:  # noqa: BLE001 - the caller gets it as a reason
      reply("error", f"exception: {type(e).__name__}: {str(e)[:200]}")


class ReplyTooLarge(Exception):
  """A child's reply passed `max_reply_bytes`."""


class _Child:
  """One child process and its pipes (JSON lines: no pickle crosses the boundary)."""

  def __init__(self, function: str, memory_bytes: int, start_timeout_s: float,
               max_reply_bytes: int = 1 << 20):
    self.max_reply_bytes = max_reply_bytes
    self.process = subprocess.Popen(
        [sys.executable, "-m", "arl_jax.envs.child_calls", function, str(memory_bytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True)  # (a signal to the run's process group does not reach it)
    self._buffer = b""
    try:
      ready = self.read(start_timeout_s)
    except EOFError:
      ready = None
    if ready != ["ready", None]:
      self.kill()
      raise RuntimeError(f"a child for {function} did not start in {start_timeout_s} s "
                         "(is its module importable?)")

  def send(self, args) -> None:
    self.process.stdin.write((json.dumps(list(args)) + "\n").encode())
    self.process.stdin.flush()

  def read(self, timeout_s: float):
    """The next reply, or None if none came within `timeout_s`.

    Raises:
      EOFError: the child exited.
    """
    deadline = time.monotonic() + timeout_s
    fd = self.process.stdout.fileno()
    while b"\n" not in self._buffer:
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        return None
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        raise EOFError("the child closed its output")
      self._buffer += chunk
      if len(self._buffer) > self.max_reply_bytes:  # (read no further: the child goes)
        raise ReplyTooLarge(f"reply over {self.max_reply_bytes} bytes")
    line, _, self._buffer = self._buffer.partition(b"\n")
    return json.loads(line)

  def kill(self) -> None:
    self.process.kill()
    self.process.wait(5)
    for pipe in (self.process.stdin, self.process.stdout):
      pipe.close()


class ChildPool:
  """`call(*args)` runs `function(*args)` in one of up to `workers` children.

  Thread-safe. `function` is `"module:name"` (imported in a fresh
  interpreter); its arguments and result travel as JSON.
  """

  def __init__(self, function: str, *, workers: int = 2, timeout_s: float = 5.0,
               memory_bytes: int = 2 << 30, start_timeout_s: float = 60.0):
    if workers < 1 or timeout_s <= 0:
      raise ValueError(f"ChildPool needs workers >= 1 and timeout_s > 0, got {workers}, "
                       f"{timeout_s}")
    self.function, self.timeout_s = function, timeout_s
    self._memory, self._start_timeout = memory_bytes, start_timeout_s
    self._idle: queue.Queue = queue.Queue()
    self._slots = threading.BoundedSemaphore(workers)
    self._lock = threading.Lock()
    self._children: set[_Child] = set()
    self.counts = {"calls": 0, "timeouts": 0, "deaths": 0, "exceptions": 0}

  def call(self, *args) -> Outcome:
    with self._slots:  # (at most `workers` calls at once, each with its own child)
      try:
        child = self._idle.get_nowait()
      except queue.Empty:
        child = _Child(self.function, self._memory, self._start_timeout)
        with self._lock:
          self._children.add(child)
      outcome = self._ask(child, args)
      if outcome.reason.startswith(("timeout", "child died")):
        self._forget(child)
      else:
        self._idle.put(child)
      return outcome

  def _ask(self, child: _Child, args) -> Outcome:
    with self._lock:
      self.counts["calls"] += 1
    try:
      child.send(args)
      reply = child.read(self.timeout_s)
      if reply is None:
        self._count("timeouts")
        return Outcome(False, reason=f"timeout after {self.timeout_s} s")
      kind, value = reply
    except ReplyTooLarge as e:
      self._count("deaths")
      return Outcome(False, reason=f"child died: killed, {e}")
    except (EOFError, OSError) as e:  # (killed by its memory cap, or a crash)
      self._count("deaths")
      return Outcome(False, reason=f"child died: {type(e).__name__} (exit code "
                                   f"{child.process.poll()})")
    if kind == "ok":
      return Outcome(True, value)
    self._count("exceptions")
    return Outcome(False, reason=value)

  def _count(self, name: str) -> None:
    with self._lock:
      self.counts[name] += 1

  def _forget(self, child: _Child) -> None:
    child.kill()
    with self._lock:
      self._children.discard(child)

  def close(self) -> None:
    """Stops every child (a later `call` starts new ones)."""
    while True:
      try:
        self._idle.get_nowait()
      except queue.Empty:
        break
    with self._lock:
      children, self._children = list(self._children), set()
    for child in children:
      child.kill()


if __name__ == "__main__":
  _serve(sys.argv[1], int(sys.argv[2]))
