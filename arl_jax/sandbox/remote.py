"""A sandbox service over HTTP: SandboxFusion's `/run_code`.

SandboxFusion (bytedance/SandboxFusion) runs code in its own isolated
workers; users who have one (or another service speaking its API) point the
run at it with `sandbox.backend=sandbox_fusion` and `sandbox.url`. A request
is `{"code", "language": "python", "run_timeout", "memory_limit_MB",
"stdin", "files": {path: base64}}`; the answer's `run_result` holds
`status` (`Finished`, `TimeLimitExceeded`, `Error`), `return_code`,
`stdout`, `stderr` and `execution_time`; a top-level `status` of
`SandboxError` means the service failed, not the program.

The service is trusted to isolate; its answer is still read as untrusted
input (size-capped, every field checked) and anything but a well-formed
answer, a refused connection or an HTTP error is a `SandboxError`, which the
environment's caller counts as a fault. Only the standard library is used.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

from arl_jax.sandbox import api

_MAX_ANSWER_BYTES = 16 << 20


class SandboxFusion:
  """A client of one SandboxFusion service (calls may come from many threads).

  Attributes:
    isolation: what this sandbox guarantees, in words.
  """

  def __init__(self, url: str, *, request_slack_s: float = 30.0, api_key: str | None = None,
               max_concurrent: int = 8):
    """Args:
      url: the service's base URL (`http://host:8080`).
      max_concurrent: requests in flight at once (the rest wait).
      request_slack_s: seconds an answer may take beyond the program's wall
        limit (queueing, start-up) before the call fails.
      api_key: sent as a bearer token, when the service wants one.
    """
    if not url.startswith(("http://", "https://")):
      raise ValueError(f"sandbox.url must be an http(s) URL, got {url!r}")
    self._url = url.rstrip("/") + "/run_code"
    self._slack_s = request_slack_s
    self._headers = {"Content-Type": "application/json"}
    if api_key:
      self._headers["Authorization"] = f"Bearer {api_key}"
    self.isolation = f"the SandboxFusion service at {url}"
    self._slots = threading.BoundedSemaphore(max_concurrent)

  def close(self) -> None:
    pass

  def run(self, code: str, *, limits: api.Limits, stdin: str = "",
          files: Mapping[str, str] | None = None) -> api.Execution:
    body = json.dumps({
        "code": code, "language": "python", "run_timeout": limits.wall_s,
        "memory_limit_MB": limits.memory_mb, "stdin": stdin,
        "files": {name: base64.b64encode(text.encode("utf-8")).decode("ascii")
                  for name, text in (files or {}).items()},
    }).encode("utf-8")
    request = urllib.request.Request(self._url, data=body, headers=self._headers, method="POST")
    with self._slots:
      return self._post(request, limits)

  def _post(self, request: urllib.request.Request, limits: api.Limits) -> api.Execution:
    start = time.monotonic()
    try:
      with urllib.request.urlopen(request, timeout=limits.wall_s + self._slack_s) as response:
        raw = response.read(_MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as e:
      raise api.SandboxError(f"{self._url} answered HTTP {e.code}: "
                             f"{e.read(300).decode('utf-8', 'replace')}") from e
    except (urllib.error.URLError, OSError) as e:  # refused, unreachable, timed out
      raise api.SandboxError(f"{self._url}: {getattr(e, 'reason', e)}") from e
    if len(raw) > _MAX_ANSWER_BYTES:
      raise api.SandboxError(f"{self._url} answered more than {_MAX_ANSWER_BYTES >> 20} MiB")
    return _execution(raw, limits, time.monotonic() - start, self._url)


def _execution(raw: bytes, limits: api.Limits, elapsed_s: float, url: str) -> api.Execution:
  """The `Execution` a SandboxFusion answer describes."""
  try:
    answer = json.loads(raw)
    if answer.get("status") == "SandboxError":
      raise api.SandboxError(f"{url}: the service failed: {str(answer.get('message'))[:300]}")
    run = answer["run_result"]
    if run is None:  # a compile step failed (not for Python), or nothing ran
      raise api.SandboxError(f"{url}: no run_result ({str(answer.get('message'))[:300]})")
    state = run["status"]
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    wall_s = float(run.get("execution_time") or elapsed_s)
    exit_code = run.get("return_code")
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise api.SandboxError(f"{url} answered something that is not a SandboxFusion "
                           f"run_code answer: {e!r}") from e
  cap = limits.output_kb << 10
  over = len(stdout.encode("utf-8")) + len(stderr.encode("utf-8")) > cap
  stdout, stderr = stdout[:cap], stderr[:cap]
  if state == "TimeLimitExceeded":
    return api.Execution(status=api.TIMEOUT, exit_code=None, stdout=stdout, stderr=stderr,
                         wall_s=wall_s, reason=f"the service stopped it after "
                                                f"{limits.wall_s:g} s")
  if over:
    return api.Execution(status=api.OUTPUT_LIMIT, exit_code=None, stdout=stdout, stderr=stderr,
                         wall_s=wall_s, reason=f"wrote more than {limits.output_kb} KiB")
  if not isinstance(exit_code, int):
    exit_code = 0 if state == "Finished" else 1
  if exit_code < 0:  # killed by signal -N
    exit_code = 128 - exit_code
  return api.execution_from_exit(exit_code, stdout, stderr, wall_s, limits)
