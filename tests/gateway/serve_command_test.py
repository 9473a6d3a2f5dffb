"""`python -m arl_jax.serve`: a config's model served on a free port until
stopped; a bad config is one line on stderr and exit status 2."""

import os
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_command_serves_a_config_s_model():
  process = subprocess.Popen(
      [sys.executable, "-m", "arl_jax.serve", "--config=configs/arith.py:tiny", "--port=0",
       "--api_key=k"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline, url = time.monotonic() + 240, None
    while url is None and time.monotonic() < deadline:
      line = process.stdout.readline()
      assert line or process.poll() is None, "the server exited"
      if line.startswith("serving "):
        url = line.split(" at ")[1].split(" ")[0]
    assert url is not None
    headers = {"Authorization": "Bearer k"}
    out = httpx.post(url + "/completions", headers=headers, timeout=60,
                     json={"model": "arl_jax", "prompt": "12+7=", "max_tokens": 2,
                           "logprobs": 5, "return_tokens_as_token_ids": True}).json()
    assert len(out["choices"]) == 1 and out["usage"]["completion_tokens"] <= 2
    # (--top_logprobs: 5 alternatives recorded by default, the sampled token beside them;
    # as ids, since byte tokens' texts collide)
    assert all(5 <= len(top) <= 6 for top in out["choices"][0]["logprobs"]["top_logprobs"])
    assert httpx.get(url + "/models").status_code == 401
  finally:
    process.terminate()
    process.wait(60)


def test_a_bad_config_is_one_line_and_status_2():
  result = subprocess.run(
      [sys.executable, "-m", "arl_jax.serve", "--config=configs/arith.py:tiny",
       "--config.sampler.temperature=-1"], cwd=REPO, capture_output=True, text=True,
      timeout=120)
  assert result.returncode == 2
  assert "Traceback" not in result.stderr and "temperature" in result.stderr
