"""The sampler process on bad input: its address is checked before anything
starts, an unreachable learner is reported within seconds, and a config its
host cannot use is one error line."""

import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from arl_jax.config import run_spec
from arl_jax.core import spec_codec
from arl_jax.distributed import learner_link, sampler_worker, wire
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.testing import tiny, xla_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(*args, timeout=120):
  return subprocess.run(
      [sys.executable, "-m", "arl_jax.distributed.sampler_worker", *args], cwd=REPO,
      env=xla_env.subprocess_env(1),
      capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("address, problem", [
    ("127.0.0.1:5555", "has no scheme: write tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555)"),
    ("tcp://127.0.0.1:99999", "port '99999' is not a number in 1..65535"),
    ("tcp://127.0.0.1:0", "port '0' is not a number in 1..65535"),
    ("tcp://127.0.0.1", "expected tcp://HOST:PORT"),
    ("tcp://:5555", "expected tcp://HOST:PORT"),
    ("tcp://*:5555", "expected tcp://HOST:PORT"),
    ("ipc:///tmp/learner", "only tcp:// addresses are supported"),
])
def test_a_bad_address_is_named(address, problem):
  with pytest.raises(ValueError, match=re.escape(problem)):
    learner_link.check_address(address)


def test_good_addresses_pass():
  for address in ("tcp://127.0.0.1:5555", "tcp://learner-0.example:1", "tcp://[::1]:65535"):
    assert learner_link.check_address(address) == address


@pytest.mark.parametrize("address, problem", [
    ("127.0.0.1:5555", "write tcp://HOST:PORT"),
    ("tcp://127.0.0.1:99999", "1..65535"),
])
def test_the_command_line_rejects_a_bad_address_without_a_traceback(address, problem):
  proc = _worker(f"--learner={address}", timeout=60)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and problem in proc.stderr, proc.stderr[-3000:]


def test_an_unreachable_learner_is_reported_while_waiting_then_given_up():
  lines = []
  address = f"tcp://127.0.0.1:{_free_port()}"
  start = time.monotonic()
  with pytest.raises(learner_link.LearnerUnreachable,
                     match=re.escape(f"no learner answered at {address} within 1s")):
    learner_link.LearnerLink(address, name="s", num_devices=1, connect_timeout_s=1.0,
                               print_fn=lines.append, notice_every_s=0.3)
  assert time.monotonic() - start < 5.0
  assert len(lines) >= 2 and lines[0].startswith(f"sampler s: no answer from {address} after")
  assert "still trying (giving up after 1s)" in lines[0]


def test_the_command_line_gives_up_on_an_unreachable_learner_with_one_error():
  start = time.monotonic()
  proc = _worker(f"--learner=tcp://127.0.0.1:{_free_port()}", "--connect_timeout_s=1")
  assert proc.returncode == sampler_worker.EXIT_FAILED, proc.stdout + proc.stderr
  assert "no learner answered at tcp://127.0.0.1:" in proc.stdout, proc.stdout + proc.stderr
  assert "Traceback" not in proc.stdout + proc.stderr
  assert time.monotonic() - start < 60.0


def test_settings_this_host_cannot_use_are_one_error_line(tmp_path):
  """A fake learner welcomes the sampler with resolved settings whose
  tokenizer file is missing on this host: the sampler says so and exits, no
  traceback."""
  spec = run_spec.build(tiny.load_config("arith", "tiny"))
  missing = str(tmp_path / "tokenizer.json")
  spec = dataclasses.replace(spec, tokenizer=tokenizer_lib.TokenizerConfig(
      kind="hf", path=missing, eos_token="<eos>"))
  router = zmq.Context.instance().socket(zmq.ROUTER)
  router.linger = 0
  port = router.bind_to_random_port("tcp://127.0.0.1")

  def answer_hello():
    if router.poll(30_000):
      identity, *_ = router.recv_multipart()
      router.send_multipart([identity, *wire.encode({
          "type": "welcome", "sampler_id": 0, "spec": spec_codec.to_json(spec),
          "sampler_mesh": [["data", 1], ["tp", 1]], "weights_address": "tcp://127.0.0.1:1",
          "heartbeat_s": 0.5, "timeout_s": 5.0})])

  thread = threading.Thread(target=answer_hello)
  thread.start()
  lines = []
  try:
    code = sampler_worker.run_sampler(f"tcp://127.0.0.1:{port}", name="s",
                                      print_fn=lines.append, connect_timeout_s=30.0)
  finally:
    thread.join()
    router.close()
  assert code == sampler_worker.EXIT_BAD_INPUT
  assert lines[-1].startswith("sampler s: error: ") and missing in lines[-1], lines
