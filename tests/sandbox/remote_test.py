"""The SandboxFusion client against a stand-in service (http.server, running
programs in the local sandbox the way SandboxFusion answers), and against
services that fail: every failure is a SandboxError that names it."""

import base64
import json

import pytest

from arl_jax.sandbox import api, local, remote
from arl_jax.testing import json_server

LIMITS = api.Limits(wall_s=3.0, cpu_s=2, memory_mb=256, output_kb=16)


def _fusion_like(sandbox):
  """Answers as SandboxFusion's /run_code does, running the program here."""
  def answer(body):
    files = {k: base64.b64decode(v).decode() for k, v in body["files"].items()}
    run = sandbox.run(body["code"], stdin=body["stdin"], files=files, limits=api.Limits(
        wall_s=body["run_timeout"], memory_mb=body["memory_limit_MB"], output_kb=1024))
    status = {api.OK: "Finished", api.TIMEOUT: "TimeLimitExceeded"}.get(run.status, "Error")
    return 200, json.dumps({"status": "Success" if run.ok else "Failed", "message": "",
                            "run_result": {"status": status, "return_code": run.exit_code,
                                           "stdout": run.stdout, "stderr": run.stderr,
                                           "execution_time": run.wall_s}}).encode()
  return answer


@pytest.fixture(scope="module")
def service():
  sandbox = local.LocalSandbox(require_isolation=False, uid=None)
  server = json_server.JsonServer(_fusion_like(sandbox))
  yield server
  server.stop()


def test_programs_run_remotely_as_they_would_here(service):
  client = remote.SandboxFusion(service.url, api_key="k3y")
  run = client.run("import sys, helper\nprint(helper.X, sys.stdin.read())", limits=LIMITS,
                   stdin="in", files={"helper.py": "X = 'héllo'"})
  assert run.ok and run.stdout == "héllo in\n"
  path, headers, body = service.requests[-1]
  assert path == "/run_code" and headers["Authorization"] == "Bearer k3y"
  assert body["language"] == "python" and body["run_timeout"] == 3.0
  assert body["memory_limit_MB"] == 256
  crash = client.run("raise KeyError('x')", limits=LIMITS)
  assert crash.status == api.FAILED and crash.reason == "KeyError: 'x'"
  slow = client.run("import time\ntime.sleep(30)", limits=api.Limits(wall_s=0.5))
  assert slow.status == api.TIMEOUT
  loud = client.run("print('x' * 100_000)", limits=LIMITS)
  assert loud.status == api.OUTPUT_LIMIT and len(loud.stdout) <= 16 << 10
  hog = client.run("x = bytearray(1 << 30)", limits=LIMITS)
  assert hog.status == api.MEMORY_LIMIT


@pytest.mark.parametrize("answer, message", [
    ((500, b"internal error"), r"answered HTTP 500: internal error"),
    ((200, b"<html>not json"), r"not a SandboxFusion run_code answer"),
    ((200, b'{"status": "SandboxError", "message": "no workers"}'),
     r"the service failed: no workers"),
    ((200, b'{"status": "Failed", "run_result": null, "message": "compile"}'),
     r"no run_result \(compile\)"),
    ((200, b'{"run_result": {"stdout": "x"}}'), r"not a SandboxFusion run_code answer"),
])
def test_a_failing_service_is_a_named_sandbox_error(answer, message):
  server = json_server.JsonServer(lambda body: answer)
  try:
    with pytest.raises(api.SandboxError, match=message):
      remote.SandboxFusion(server.url).run("print(1)", limits=LIMITS)
  finally:
    server.stop()


def test_a_service_that_is_down_is_a_sandbox_error():
  server = json_server.JsonServer(lambda body: (200, b""))
  url = server.url
  server.stop()
  with pytest.raises(api.SandboxError, match="refused"):
    remote.SandboxFusion(url).run("print(1)", limits=LIMITS)


def test_a_url_that_is_not_http_is_refused():
  with pytest.raises(ValueError, match="sandbox.url must be an http"):
    remote.SandboxFusion("file:///etc/passwd")
