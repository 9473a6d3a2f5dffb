"""The local sandbox against the programs a model might write: each ends with
a status and a reason within its limits, and nothing of it outlives the run
or reaches outside its directory."""

import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from arl_jax.sandbox import api, local

LIMITS = api.Limits(wall_s=5.0, cpu_s=2, memory_mb=256, file_mb=1, processes=32, output_kb=64)


@pytest.fixture(scope="module")
def sandbox():
  try:
    return local.LocalSandbox(max_concurrent=4)
  except api.SandboxError as e:  # (a machine without namespaces: the opt-in is tested below)
    pytest.skip(f"no isolation here: {e}")


def _run(sandbox, code, **kwargs):
  return sandbox.run(code, limits=kwargs.pop("limits", LIMITS), **kwargs)


def test_a_plain_program_runs_with_its_files_and_stdin(sandbox):
  run = _run(sandbox, "import sys, data\nprint(data.X + sys.stdin.read())",
             stdin="and more", files={"data.py": "X = 'hello '"})
  assert run.ok and run.exit_code == 0 and run.stdout == "hello and more\n"
  assert "namespaces" in sandbox.isolation


def test_a_crash_fails_with_its_last_traceback_line(sandbox):
  run = _run(sandbox, "raise ValueError('boom')")
  assert run.status == api.FAILED and run.exit_code == 1
  assert run.reason == "ValueError: boom"


def test_an_infinite_loop_hits_the_cpu_limit(sandbox):
  start = time.monotonic()
  run = _run(sandbox, "while True: pass")
  assert run.status == api.CPU_LIMIT and "2 CPU seconds" in run.reason
  assert time.monotonic() - start < LIMITS.wall_s


def test_a_sleeping_program_is_killed_at_the_wall_limit(sandbox):
  start = time.monotonic()
  run = _run(sandbox, "import time\nprint('started', flush=True)\ntime.sleep(60)",
             limits=api.Limits(wall_s=1.0))
  assert run.status == api.TIMEOUT and run.exit_code is None and run.stdout == "started\n"
  assert 1.0 <= time.monotonic() - start < 3.0


def test_a_memory_hog_fails_its_allocation(sandbox):
  run = _run(sandbox, "x = bytearray(1 << 30)")
  assert run.status == api.MEMORY_LIMIT and "256 MiB" in run.reason


def test_a_flood_of_output_is_cut_and_killed(sandbox):
  start = time.monotonic()
  run = _run(sandbox, "while True: print('x' * 1000)")
  assert run.status == api.OUTPUT_LIMIT and len(run.stdout) <= 64 << 10
  assert time.monotonic() - start < 2.0


def test_non_utf8_output_is_replaced_not_fatal(sandbox):
  run = _run(sandbox, "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end')")
  assert run.ok and run.stdout == "ok \ufffd\ufffd end"


def test_no_network(sandbox):
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  port = server.getsockname()[1]
  try:
    run = _run(sandbox, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)")
    assert run.status == api.FAILED
    assert "refused" in run.reason or "unreachable" in run.reason, run.reason
    run = _run(sandbox, "import socket\nsocket.create_connection(('1.1.1.1', 80), 2)")
    assert run.status == api.FAILED and "unreachable" in run.reason, run.reason
  finally:
    server.close()


def test_writes_outside_its_directory_fail_and_tmp_is_its_own(sandbox, tmp_path):
  # A directory this test may write in, outside /tmp (which is the jail's own).
  target = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".planted_{os.getpid()}")
  run = _run(sandbox, f"open({target!r}, 'w').write('x')")
  assert run.status == api.FAILED and not os.path.exists(target)
  # (a checkout under a home directory is hidden in the jail: not found there)
  assert any(why in run.reason for why in ("Read-only file system", "Permission denied",
                                           "No such file")), run.reason
  run = _run(sandbox, f"open({str(tmp_path / 'planted')!r}, 'w').write('x')")
  assert run.status == api.FAILED and not (tmp_path / "planted").exists()
  marker = f"arl_sandbox_test_{os.getpid()}"
  run = _run(sandbox, f"open('/tmp/{marker}', 'w').write('x')\n"
                      f"open('written.txt', 'w').write('y')\nprint(open('written.txt').read())")
  assert run.ok and run.stdout == "y\n"
  assert not os.path.exists(f"/tmp/{marker}")  # (a tmpfs that died with the jail)
  run = _run(sandbox, "open('big', 'wb').write(b'x' * (4 << 20))")  # over file_mb
  assert run.status == api.FAILED


def test_home_directories_are_hidden(sandbox):
  secret = os.path.expanduser("~/.arl_sandbox_secret")
  with open(secret, "w") as f:
    f.write("token")
  try:
    run = _run(sandbox, f"print(open({secret!r}).read())")
    assert run.status == api.FAILED and "token" not in run.stdout
  finally:
    os.remove(secret)


def test_a_fork_bomb_ends_and_leaves_nothing_behind(sandbox):
  start = time.monotonic()
  run = _run(sandbox, "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n"
                      "    pass", limits=api.Limits(wall_s=2.0, processes=32))
  assert run.status in (api.TIMEOUT, api.CPU_LIMIT), run
  assert time.monotonic() - start < 5.0
  _assert_no_process_of(local.NOBODY)


def test_a_process_that_leaves_the_group_dies_with_the_jail(sandbox):
  run = _run(sandbox, "import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\n"
                      "print('parent done')", limits=api.Limits(wall_s=2.0))
  assert run.ok and run.stdout == "parent done\n"
  _assert_no_process_of(local.NOBODY)


def test_it_sees_only_its_own_processes(sandbox):
  run = _run(sandbox, "import os\nprint(sorted(int(p) for p in os.listdir('/proc') "
                      "if p.isdigit()), os.getuid())")
  assert run.ok
  pids, uid = run.stdout.rsplit(" ", 1)
  assert pids == "[1]"
  if os.geteuid() == 0:
    assert int(uid) == local.NOBODY


def test_it_holds_no_capability_and_cannot_unhide_what_is_hidden(sandbox):
  run = _run(sandbox, "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                      "print(libc.umount2(b'/home', 2), ctypes.get_errno())\n"
                      "print([l.split()[1] for l in open('/proc/self/status') "
                      "if l.startswith(('CapPrm', 'CapEff'))])")
  assert run.ok and run.stdout.splitlines() == ["-1 1", "['0000000000000000', "
                                                "'0000000000000000']"], run


UNPRIVILEGED = """
import sys
sys.path.insert(0, sys.argv[1])
from arl_jax.sandbox import api, local
sandbox = local.LocalSandbox()
limits = api.Limits(wall_s=3, cpu_s=1, memory_mb=256)
for code in ["import os; print(os.listdir('/proc')[:0], open('/proc/self/status').read().count('CapEff:\\t0000000000000000'))",
             "import socket; socket.create_connection(('1.1.1.1', 80), 1)",
             "while True: pass"]:
  run = sandbox.run(code, limits=limits)
  print(run.status, run.stdout.strip() or run.reason)
print(sandbox.isolation)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv")
                    or not os.path.exists("/usr/bin/python3"),
                    reason="runs the jail as an unprivileged user: needs root to become one")
def test_an_unprivileged_caller_gets_a_user_namespace():
  """The path a non-root machine takes (a user namespace maps the caller to
  root inside, every capability dropped before the program runs), run here
  as uid 65534 with the system interpreter and a copy of the package."""
  tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="arl_unprivileged_"))  # (uid 65534 reads it)
  try:
    _run_unprivileged(tmp_path)
  finally:
    shutil.rmtree(tmp_path, ignore_errors=True)


def _run_unprivileged(tmp_path):
  package = tmp_path / "arl_jax"
  package.mkdir()
  (package / "__init__.py").write_text("")
  shutil.copytree(os.path.dirname(local.__file__), package / "sandbox")
  (tmp_path / "probe.py").write_text(UNPRIVILEGED)
  for path in [tmp_path, *tmp_path.rglob("*")]:
    path.chmod(0o755)
  proc = subprocess.run(["/usr/bin/setpriv", "--reuid=65534", "--regid=65534",
                         "--clear-groups", "/usr/bin/python3", "-I", str(tmp_path / "probe.py"),
                         str(tmp_path)], capture_output=True, text=True, timeout=60,
                        cwd="/")
  if "cannot isolate" in proc.stderr:
    pytest.skip(f"no unprivileged user namespaces here: {proc.stderr[-300:]}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.splitlines()
  assert lines[0] == "ok [] 1"
  assert lines[1].startswith("failed") and "unreachable" in lines[1]
  assert lines[2].startswith("cpu_limit")
  assert "user)" in lines[3]


def test_many_programs_run_at_once_and_the_caller_is_not_blocked(sandbox):
  results, ticks = [], []
  stop = threading.Event()

  def tick():  # the sampler's stand-in: it must keep running
    while not stop.is_set():
      ticks.append(time.monotonic())
      time.sleep(0.01)

  ticker = threading.Thread(target=tick)
  ticker.start()
  threads = [threading.Thread(target=lambda i=i: results.append(_run(
      sandbox, f"import time\ntime.sleep(0.5)\nprint({i})"))) for i in range(8)]
  start = time.monotonic()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  elapsed = time.monotonic() - start
  stop.set()
  ticker.join()
  assert sorted(int(r.stdout) for r in results) == list(range(8))
  assert elapsed < 8 * 0.5  # four at a time (max_concurrent), not one
  assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.5


def test_file_names_must_stay_in_the_directory(sandbox):
  for name in ("../escape.py", "/etc/x", ""):
    with pytest.raises(ValueError, match="relative path"):
      _run(sandbox, "pass", files={name: "x"})


def test_without_isolation_it_runs_only_on_opt_in(monkeypatch):
  monkeypatch.setattr(local, "_unsupported_reason", lambda: "namespaces are off in this test")
  with pytest.raises(api.SandboxError, match=r"env\.sandbox\.require_isolation=False"):
    local.LocalSandbox()
  # (as root, keep root: the programs' interpreter may lie where uid 65534
  # cannot read it, as /root/.pyenv does on these machines)
  sandbox = local.LocalSandbox(require_isolation=False, uid=None)
  assert not sandbox.isolated and sandbox.isolation.startswith("none (namespaces are off")
  assert sandbox.run("print(1)", limits=LIMITS).stdout == "1\n"
  run = sandbox.run("while True: pass", limits=LIMITS)
  assert run.status == api.CPU_LIMIT
  run = sandbox.run("import time\ntime.sleep(60)", limits=api.Limits(wall_s=0.5))
  assert run.status == api.TIMEOUT


def _assert_no_process_of(uid):
  if os.geteuid() != 0:
    return  # (not root: the programs ran as this user, beside this test's own processes)
  deadline = time.monotonic() + 2.0
  while True:
    left = subprocess.run(["ps", "-u", str(uid), "-o", "pid="], capture_output=True,
                          text=True).stdout.split()
    if not left or time.monotonic() > deadline:
      break
    time.sleep(0.1)
  assert not left, f"processes of uid {uid} outlived their sandbox: {left}"
