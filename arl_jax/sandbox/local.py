"""A sandbox on this machine: each program in a child process, jailed.

Each run gets a fresh directory (removed afterwards) and a jail process
(`_jail.py`, a new interpreter with nothing of the run) that puts the
program in new Linux namespaces: no network, read-only mounts but its own
directory and a small /tmp, home directories hidden, a PID namespace the
whole of which dies with it, an unprivileged uid when the run is root; and
under resource limits (CPU seconds, address space, file size, processes,
open files). This process watches it: output is read up to the cap (then
the jail is killed), and at the wall limit the jail's process group is
killed with SIGKILL, which takes the namespace's every process with it.

Isolation needs Linux with unprivileged user namespaces (or root). The
sandbox probes it once at construction; where it is unavailable it raises
`SandboxError` naming why, unless `require_isolation=False`, in which case
programs run with the limits only (no network or file isolation, and a
process that leaves the process group outlives the kill), and `isolation`
says so.

Runs are blocking calls, made from the environment's worker threads; at
most `max_concurrent` run at once (the rest wait), none of them holds the
GIL while the program runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping

from arl_jax.sandbox import api

_JAIL = str(pathlib.Path(__file__).with_name("_jail.py"))
_SETUP_FAILED = 121  # `_jail.SETUP_FAILED`
NOBODY = 65534


class LocalSandbox:
  """Runs each program in a jailed child process (see the module docstring).

  Attributes:
    isolation: what this sandbox guarantees, in words.
    isolated: whether programs run in namespaces.
  """

  def __init__(self, *, require_isolation: bool = True, uid: int | None = NOBODY,
               max_concurrent: int = 8, base_dir: str | None = None,
               python: str | None = None):
    """Args:
      require_isolation: raise `SandboxError` when namespaces are
        unavailable, rather than run with limits only.
      uid: the user a root run's programs run as (root is exempt from the
        process limit and may write anywhere); None: keep the caller's
        (only honoured without isolation; ignored when not root).
      max_concurrent: programs running at once.
      base_dir: where run directories are made (default: the system's).
      python: the interpreter that runs programs (default: this one).
    """
    self._uid = uid if os.geteuid() == 0 else None
    self._python = python or sys.executable
    self._base_dir = base_dir
    self._slots = threading.BoundedSemaphore(max_concurrent)
    self.isolated = True
    reason = _unsupported_reason()
    if reason is None:
      probe = self._probe()
      reason = None if probe.ok else f"the probe program ended {probe.status}: {probe.reason}"
    if reason is not None:
      if require_isolation:
        raise api.SandboxError(
            f"the local sandbox cannot isolate programs here ({reason}); run on Linux with "
            f"user namespaces enabled (or as root), use env.sandbox.backend='sandbox_fusion', "
            f"or set env.sandbox.require_isolation=False to run them with resource limits "
            f"only (no network or file isolation)")
      self.isolated = False
      self.isolation = f"none ({reason}): resource limits and a process group only"
      probe = self._probe()
      if not probe.ok:
        raise api.SandboxError(f"the local sandbox cannot run programs here, even without "
                               f"isolation: the probe program ended {probe.status}: "
                               f"{probe.reason}")
    else:
      self.isolation = ("Linux namespaces (mount, network, PID, IPC, UTS"
                        + (f"; uid {self._uid})" if self._uid is not None else "; user)")
                        + ", read-only mounts, limits")

  def _probe(self) -> api.Execution:
    try:
      return self.run("print('ok')", limits=api.Limits(wall_s=30.0))
    except api.SandboxError as e:
      return api.Execution(status=api.FAILED, exit_code=None, stdout="", stderr="",
                           wall_s=0.0, reason=str(e))

  def close(self) -> None:
    pass

  def run(self, code: str, *, limits: api.Limits, stdin: str = "",
          files: Mapping[str, str] | None = None) -> api.Execution:
    with self._slots:
      workdir = tempfile.mkdtemp(prefix="arl_sandbox_", dir=self._base_dir)
      try:
        self._write_files(workdir, {**(files or {}), "main.py": code})
        return self._run_in(workdir, limits, stdin)
      finally:
        shutil.rmtree(workdir, ignore_errors=True)

  def _write_files(self, workdir: str, files: Mapping[str, str]) -> None:
    root = pathlib.Path(workdir)
    for name, text in files.items():
      relative = pathlib.PurePosixPath(name)
      if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ValueError(f"sandbox file name {name!r} must be a relative path inside the "
                         f"program's directory")
      path = root / relative
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text, encoding="utf-8")
    if self._uid is not None:
      for path in [root, *root.rglob("*")]:
        os.chown(path, self._uid, self._uid)

  def _run_in(self, workdir: str, limits: api.Limits, stdin: str) -> api.Execution:
    status_read, status_write = os.pipe()
    settings = {
        "isolate": self.isolated, "workdir": workdir, "status_fd": status_write,
        # (-E -s, not -I: the program's directory is on its path, for its files)
        "argv": [self._python, "-E", "-s", "main.py"], "uid": self._uid,
        "cpu_s": int(limits.cpu_s), "memory_bytes": limits.memory_mb << 20,
        "file_bytes": limits.file_mb << 20, "tmpfs_bytes": limits.file_mb << 20,
        "nproc": int(limits.processes), "nofile": 64,
        "hide": _hidden_dirs(), "expose": _interpreter_dirs(),
    }
    start = time.monotonic()
    try:
      proc = subprocess.Popen(
          [self._python, "-I", "-S", _JAIL, json.dumps(settings)], cwd=workdir,
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          pass_fds=(status_write,), start_new_session=True, env={})
    except OSError as e:
      os.close(status_read)
      raise api.SandboxError(f"cannot start the jail: {e}") from e
    finally:
      os.close(status_write)
    try:
      return _watch(proc, status_read, stdin.encode("utf-8"), limits, start)
    finally:
      _kill(proc)
      os.close(status_read)


def _watch(proc: subprocess.Popen, status_read: int, stdin: bytes, limits: api.Limits,
           start: float) -> api.Execution:
  """Reads the program's output until it ends, the wall limit or the output cap."""
  threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
  cap = limits.output_kb << 10
  out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
  status = bytearray()
  deadline = start + limits.wall_s
  ended = None
  with selectors.DefaultSelector() as selector:
    for fd in (*out, status_read):
      selector.register(fd, selectors.EVENT_READ)
    while selector.get_map():
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        ended = api.TIMEOUT
        break
      for key, _ in selector.select(min(remaining, 0.5)):
        chunk = os.read(key.fd, 65536)
        if not chunk:
          selector.unregister(key.fd)
        elif key.fd == status_read:
          status += chunk[:4096]
        else:
          out[key.fd] += chunk
      if sum(len(b) for b in out.values()) > cap:
        ended = api.OUTPUT_LIMIT
        break
  if ended is None:
    try:
      proc.wait(max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
      ended = api.TIMEOUT
  if ended is not None:
    _kill(proc)
  wall_s = time.monotonic() - start
  if status:
    raise api.SandboxError(f"the jail could not start the program: "
                           f"{_setup_failure(bytes(status))}")
  stdout, stderr = (bytes(b[:cap]).decode("utf-8", "replace") for b in out.values())
  if ended == api.TIMEOUT:
    return api.Execution(status=ended, exit_code=None, stdout=stdout, stderr=stderr,
                         wall_s=wall_s, reason=f"killed after the wall limit of "
                                                f"{limits.wall_s:g} s")
  if ended == api.OUTPUT_LIMIT:
    return api.Execution(status=ended, exit_code=None, stdout=stdout, stderr=stderr,
                         wall_s=wall_s, reason=f"killed after writing more than "
                                                f"{limits.output_kb} KiB")
  code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
  if code == _SETUP_FAILED and not stdout and not stderr:
    raise api.SandboxError("the jail ended before starting the program")
  return api.execution_from_exit(code, stdout, stderr, wall_s, limits)


def _feed(pipe, data: bytes) -> None:
  try:
    if data:
      pipe.write(data)
    pipe.close()
  except (BrokenPipeError, OSError, ValueError):
    pass  # the program did not read it all, or is gone


def _kill(proc: subprocess.Popen) -> None:
  """Kills the jail's process group (the jail, and PID 1 of its namespace,
  whose death ends every process in it) and reaps the jail."""
  if proc.returncode is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  proc.wait()
  for pipe in (proc.stdin, proc.stdout, proc.stderr):
    try:
      pipe.close()
    except OSError:
      pass


def _setup_failure(status: bytes) -> str:
  try:
    return json.loads(status.decode("utf-8", "replace").splitlines()[0])["setup_failed"]
  except (ValueError, KeyError, IndexError, TypeError):
    return status[:200].decode("utf-8", "replace")


def _unsupported_reason() -> str | None:
  if not sys.platform.startswith("linux"):
    return f"namespaces are Linux's; this is {sys.platform}"
  return None


def _hidden_dirs() -> list[str]:
  """Directories covered by an empty tmpfs inside the jail: where keys,
  tokens and the user's files live."""
  dirs = {"/root", "/home", os.path.expanduser("~")}
  return sorted(d for d in dirs if d not in ("/", "") and os.path.isdir(d))


def _interpreter_dirs() -> list[str]:
  """What the program's interpreter reads (its installation, the virtual
  environment and its site-packages), bound back if under a hidden dir."""
  dirs = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix}
  dirs.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
  return sorted(d for d in dirs if os.path.isdir(d))
