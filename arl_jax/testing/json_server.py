"""A stand-in HTTP service for tests: answers each JSON POST with what a
function of its body says (a sandbox service, a judge's server)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable


class JsonServer(http.server.ThreadingHTTPServer):
  """Serves on 127.0.0.1 (any free port) from a daemon thread.

  Attributes:
    requests: `(path, headers, body)` of every POST, in arrival order.
  """

  daemon_threads = True

  def __init__(self, answer_fn: Callable[[dict], tuple[int, bytes]]):
    """`answer_fn(body) -> (HTTP status, raw answer)`."""
    super().__init__(("127.0.0.1", 0), _Handler)
    self.answer_fn, self.requests = answer_fn, []
    threading.Thread(target=self.serve_forever, daemon=True).start()

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.server_address[1]}"

  def stop(self) -> None:
    self.shutdown()
    self.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):
    pass

  def do_POST(self):  # noqa: N802 - http.server's name
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    self.server.requests.append((self.path, dict(self.headers), body))
    code, raw = self.server.answer_fn(body)
    self.send_response(code)
    self.send_header("Content-Length", str(len(raw)))
    self.end_headers()
    self.wfile.write(raw)
