"""What a sandbox is: runs a program a model wrote and says how it ended.

Code a model wrote is hostile input. Every backend runs it somewhere it
cannot reach the run (its files, its network, its processes), bounds what it
may spend (CPU time, memory, file size, processes, output, wall time), and
answers with an `Execution` whatever the program did: an infinite loop, a
fork bomb or a crash is an outcome with a reason, never an exception of the
caller. Only the sandbox itself failing (a remote service down, a jail that
could not be set up) raises `SandboxError`, which an environment's caller
counts as a fault.

Backends: `local.LocalSandbox` (a child process in Linux namespaces) and
`remote.SandboxFusion` (a SandboxFusion service's `/run_code`).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping
from typing import Protocol

# How a program ended (`Execution.status`).
OK = "ok"  # exit status 0
FAILED = "failed"  # it exited with another status, or a signal of its own ended it
TIMEOUT = "timeout"  # it outlived the wall limit and was killed (with every process it made)
CPU_LIMIT = "cpu_limit"  # it used its CPU seconds
MEMORY_LIMIT = "memory_limit"  # an allocation failed under the memory cap
OUTPUT_LIMIT = "output_limit"  # it wrote more than the output cap and was killed
STATUSES = (OK, FAILED, TIMEOUT, CPU_LIMIT, MEMORY_LIMIT, OUTPUT_LIMIT)


class SandboxError(Exception):
  """The sandbox could not run the program (not the program's fault)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
  """What one program may spend.

  Attributes:
    wall_s: seconds from start to kill, whatever it is doing (sleeping,
      blocked, spinning).
    cpu_s: CPU seconds (whole seconds; a process tree shares none of it:
      the limit is per process).
    memory_mb: address space of each process, MiB.
    file_mb: the largest file it may write, MiB (and the tmpfs it writes in).
    processes: processes and threads it may run at once.
    output_kb: stdout and stderr together, KiB, before it is killed.
  """

  wall_s: float = 10.0
  cpu_s: int = 10
  memory_mb: int = 512
  file_mb: int = 16
  processes: int = 16
  output_kb: int = 256

  def __post_init__(self):
    for name in ("wall_s", "cpu_s", "memory_mb", "file_mb", "processes", "output_kb"):
      if not getattr(self, name) > 0:
        raise ValueError(f"sandbox limit {name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Execution:
  """How a program ended.

  Attributes:
    status: one of STATUSES.
    exit_code: its exit status (128 + N when signal N ended it); None when
      it was killed by the sandbox or never reported one.
    stdout, stderr: what it wrote, decoded as UTF-8 with bad bytes replaced,
      each cut at the output cap.
    wall_s: seconds it ran.
    reason: a line for humans and logs: why it ended so (the last line of a
      traceback, the limit it hit).
  """

  status: str
  exit_code: int | None
  stdout: str
  stderr: str
  wall_s: float
  reason: str = ""

  def __post_init__(self):
    if self.status not in STATUSES:
      raise ValueError(f"unknown execution status {self.status!r}; known: {STATUSES}")

  @property
  def ok(self) -> bool:
    return self.status == OK


def execution_from_exit(code: int, stdout: str, stderr: str, wall_s: float,
                        limits: Limits) -> Execution:
  """How a program that ended by itself (or by a resource limit) ended,
  from its exit status (128 + N for signal N) and what it wrote."""
  last_line = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
  if code == 0:
    status, reason = OK, ""
  elif code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL) and wall_s >= limits.cpu_s * 0.5:
    # The soft CPU limit sends SIGXCPU, the hard one a second later SIGKILL.
    status, reason = CPU_LIMIT, f"used its {limits.cpu_s} CPU seconds"
  elif last_line.startswith("MemoryError"):
    status, reason = MEMORY_LIMIT, f"an allocation failed under {limits.memory_mb} MiB"
  elif code > 128 and code - 128 in {s.value for s in signal.Signals}:
    status, reason = FAILED, f"ended by signal {signal.Signals(code - 128).name}"
  else:
    status, reason = FAILED, last_line[:300] or f"exit status {code}"
  return Execution(status=status, exit_code=code, stdout=stdout, stderr=stderr, wall_s=wall_s,
                   reason=reason)


class Sandbox(Protocol):
  """Runs Python programs, one per call; calls may come from many threads.

  Attributes:
    isolation: what the backend guarantees, in words (logged at start).
  """

  isolation: str

  def run(self, code: str, *, limits: Limits, stdin: str = "",
          files: Mapping[str, str] | None = None) -> Execution:
    """Runs `code` as `main.py` in a fresh directory holding `files`
    (relative path -> text), with `stdin` on its standard input."""

  def close(self) -> None:
    """Frees what the backend holds (connections, directories)."""
