"""The local sandbox against the programs a model might write: each ends with
a status and a reason within its limits, and nothing of it outlives the run
or reaches outside its directory."""

import os
import socket
import subprocess
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
  assert "Read-only file system" in run.reason or "Permission denied" in run.reason, run.reason
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
