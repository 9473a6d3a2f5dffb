"""Hostile and mistaken requests, each answered with an OpenAI error object
(status, message naming the problem) before anything is sampled, never a
hung slot or a dead server; a client that leaves mid-generation has its
segment cancelled at once (over a scripted engine: what reaches it is seen)."""

import json
import threading
import time

import httpx
import pytest

from arl_jax.testing import served
from tests.gateway import scripted

pytest.importorskip("fastapi")

KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HELLO = [{"role": "user", "content": "Hello"}]


def _script(context: str):
  return None if "hang" in context else "Hi there.<|im_end|>"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
  tokenizer = served.chat_tokenizer(str(tmp_path_factory.mktemp("tok")))
  http, gateway, engine = scripted.start(tokenizer, _script, prompt_len=64, max_new_tokens=32,
                                         api_key=KEY, max_n=4, max_request_bytes=20_000,
                                         max_messages=8)
  yield http, gateway, engine
  http.stop()


def _post(http, path, body, headers=AUTH, **kwargs):
  data = body if isinstance(body, (bytes, str)) else json.dumps(body)
  return httpx.post(http.base_url.removesuffix("/v1") + path, content=data,
                    headers={"Content-Type": "application/json", **headers}, timeout=30, **kwargs)


def _chat(http, headers=AUTH, **fields):
  return _post(http, "/v1/chat/completions", {"model": "arl_jax", "messages": HELLO, **fields},
               headers)


def _error(response, status):
  assert response.status_code == status, response.text
  error = response.json()["error"]
  assert set(error) == {"message", "type", "param", "code"} and error["message"]
  return error


@pytest.mark.parametrize("fields,param,words", [
    ({"temperature": 0.7}, "temperature", "samples at temperature=1.0"),
    ({"top_p": 0.9}, "top_p", "top_p=1.0"),
    ({"n": 5}, "n", "at most 4"),
    ({"max_tokens": 33}, "max_tokens", "maximum context length"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "only 0.0"),
    ({"logit_bias": {"5": 3.0}}, "logit_bias", "behaviour distribution"),
    ({"tool_choice": "required"}, "tool_choice", "constrained decoding"),
    ({"top_logprobs": 3, "logprobs": True}, "top_logprobs", "sampler.top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs=true"),
    ({"response_format": {"type": "json_object"}}, "response_format", "constrained"),
    ({"stop_token_ids": [7]}, "stop_token_ids", "stops on"),
    ({"stop": ["a"] * 9}, "stop", "at most 8"),
    ({"bogus_field": 1}, "bogus_field", "unknown field"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": "x"}] * 9}, "messages", "at most 8"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "only text parts"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c", "type": "function", "function": {
                       "name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not a JSON object"),
    ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages",
     "maximum context length is 96"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set"),
])
def test_a_bad_chat_request_is_a_400_naming_its_field(gateway, fields, param, words):
  http, _, engine = gateway
  before = len(engine.cancelled)
  error = _error(_chat(http, **fields), 400)
  assert error["param"] == param and words in error["message"], error
  assert len(engine.cancelled) == before  # (nothing reached the engine)


def test_malformed_json_and_a_non_object_body_are_400s(gateway):
  http, _, _ = gateway
  assert "not valid JSON" in _error(_post(http, "/v1/chat/completions", b"{not json"), 400)[
      "message"]
  assert "JSON object" in _error(_post(http, "/v1/chat/completions", b"[1, 2]"), 400)["message"]
  assert "not valid JSON" in _error(_post(http, "/v1/completions", b"\xff\xfe"), 400)["message"]


def test_an_unknown_model_is_a_404(gateway):
  http, _, _ = gateway
  error = _error(_chat(http, model="gpt-9"), 404)
  assert error["code"] == "model_not_found" and "'arl_jax'" in error["message"]


def test_a_body_over_the_limit_is_a_413(gateway):
  http, _, _ = gateway
  big = json.dumps({"model": "arl_jax", "messages": [{"role": "user", "content": "x" * 30_000}]})
  _error(_post(http, "/v1/chat/completions", big), 413)


def test_the_api_key_is_required_everywhere_but_health(gateway):
  http, _, _ = gateway
  assert _error(_chat(http, headers={}), 401)["code"] == "invalid_api_key"
  _error(_chat(http, headers={"Authorization": "Bearer wrong"}), 401)
  base = http.base_url
  assert httpx.get(base + "/models").status_code == 401
  assert httpx.get(base.removesuffix("/v1") + "/health").json() == {"status": "ok"}
  models = httpx.get(base + "/models", headers=AUTH).json()
  assert models["data"][0]["id"] == "arl_jax" and models["data"][0]["max_model_len"] == 96


def test_an_unknown_route_and_method_are_openai_shaped(gateway):
  http, _, _ = gateway
  assert httpx.get(http.base_url + "/nothing").json()["error"]["message"]
  assert httpx.get(http.base_url + "/chat/completions").status_code == 405
  # (the session routes share a path by method: another method is a 405, no key a 401)
  put = httpx.put(http.base_url + "/sessions/s-x", headers=AUTH)
  assert put.status_code == 405 and put.json()["error"]["message"]
  _error(httpx.get(http.base_url + "/sessions/s-x"), 401)
  _error(httpx.delete(http.base_url + "/sessions/s-x"), 401)


def test_a_prompt_out_of_the_vocabulary_or_too_long_is_refused(gateway):
  http, _, _ = gateway
  body = {"model": "arl_jax", "prompt": [1, 2, 10**6]}
  assert "outside the vocabulary" in _error(_post(http, "/v1/completions", body), 400)["message"]
  body = {"model": "arl_jax", "prompt": list(range(96))}  # (max_model_len: 64 + 32)
  assert _error(_post(http, "/v1/completions", body), 400)["code"] == "context_length_exceeded"
  body = {"model": "arl_jax", "token_ids": [1] * 96}
  _error(_post(http, "/inference/v1/generate", body), 400)


def test_a_client_that_disconnects_has_its_segment_cancelled_at_once(gateway):
  http, gw, engine = gateway
  before = gw.counters["disconnected"]
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(http.base_url + "/chat/completions", headers=AUTH, timeout=0.5,
               json={"model": "arl_jax", "messages": [{"role": "user", "content": "hang"}]})
  deadline = time.monotonic() + 5
  while gw.counters["disconnected"] == before and time.monotonic() < deadline:
    time.sleep(0.02)
  assert gw.counters["disconnected"] == before + 1
  assert engine.held == {} and gw.port.open_segments == 0
  # The server goes on serving.
  assert _chat(http).status_code == 200


def test_a_fault_inside_the_server_is_a_500_and_the_server_serves_on(gateway):
  http, _, engine = gateway
  engine.fail_next = True
  error = _error(_chat(http), 500)
  assert error["type"] == "server_error" and "scripted fault" in error["message"]
  assert _chat(http).json()["choices"][0]["message"]["content"] == "Hi there."


def test_many_clients_at_once_each_get_their_answer(gateway):
  http, _, _ = gateway
  results = []

  def one(i):
    results.append(_chat(http, user=f"client-{i}").status_code)

  threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert results == [200] * 32


def test_sessions_are_read_rewarded_and_deleted(gateway):
  http, _, _ = gateway
  base = http.base_url
  assert _chat(http, user="s-1").status_code == 200
  session = httpx.get(base + "/sessions/s-1", headers=AUTH).json()
  assert session["turns"] == 1 and len(session["branches"]) == 1
  reward = httpx.post(base + "/sessions/s-1/reward", headers=AUTH, json={"reward": 0.5})
  assert reward.json()["reward"] == 0.5
  assert _error(httpx.post(base + "/sessions/s-1/reward", headers=AUTH,
                           json={"reward": "high"}), 400)["param"] == "reward"
  assert httpx.delete(base + "/sessions/s-1", headers=AUTH).json()["deleted"]
  _error(httpx.get(base + "/sessions/s-1", headers=AUTH), 404)
