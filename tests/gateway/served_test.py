"""The gateway over the real sampler engine (a random tiny decoder): what an
`openai` client gets is what the engine sampled, every turn of a session
extends the last one's exact tokens, and the recorded log-probs are the
learner's at lag 0."""

import asyncio
import time

import httpx
import numpy as np
import openai
import pytest

from arl_jax.testing import served as served_lib
from arl_jax.testing import slots as slots_lib

pytest.importorskip("fastapi")

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  s = served_lib.start_tiny(str(tmp_path_factory.mktemp("tok")), top_logprobs=5)
  yield s
  s.server.stop()


@pytest.fixture(scope="module")
def client(served):
  return openai.OpenAI(base_url=served.base_url, api_key="unused")


def _session(served, session_id):
  return httpx.get(f"{served.base_url}/sessions/{session_id}").json()


def _learner_logprobs(served, prompt_ids, completion_ids):
  tokens = np.array([*prompt_ids, *completion_ids], np.int32)
  logp = slots_lib.teacher_forced_logprobs(served.graphdef, served.params, tokens,
                                           np.ones(tokens.shape, bool))[0]
  return logp[len(prompt_ids):]


def test_turns_of_a_session_extend_each_other_s_exact_tokens(served, client):
  first = client.chat.completions.create(
      model="arl_jax", messages=QUESTION, max_tokens=12, logprobs=True,
      extra_headers={"X-Session-ID": "exact"}, extra_body={"return_token_ids": True})
  p1, t1 = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
  tokenizer = served.tokenizer
  assert p1 == tokenizer.encode(tokenizer.template.format_chat(QUESTION))
  assert [c.logprob for c in first.choices[0].logprobs.content] == pytest.approx(
      _session(served, "exact")["branches"][0]["logprobs"], abs=0)
  messages = [*QUESTION, first.choices[0].message.model_dump(exclude_unset=True),
              {"role": "user", "content": "And in Rome?"}]
  second = client.chat.completions.create(
      model="arl_jax", messages=messages, max_tokens=12,
      extra_headers={"X-Session-ID": "exact"}, extra_body={"return_token_ids": True})
  p2, t2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
  assert p2[:len(p1) + len(t1)] == p1 + t1  # never re-tokenised
  closing = "" if first.choices[0].finish_reason == "stop" else "<|im_end|>"
  assert tokenizer.detokenize(p2[len(p1) + len(t1):], skip_special_tokens=False) == (
      closing + "\n<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n")
  session = _session(served, "exact")
  assert session["turns"] == 2 and session["breaks"] == 0
  branch = session["branches"][-1]
  assert branch["prompt_ids"] + branch["completion_ids"] == p2 + t2
  mask = np.array(branch["loss_mask"])
  assert (mask[:len(t1)] == 1).all() and (mask[len(p2) - len(p1):] == 1).all()
  assert (mask[len(t1):len(p2) - len(p1)] == 0).all()


def test_the_recorded_log_probs_are_the_learner_s_at_lag_0(served, client):
  messages = list(QUESTION)
  for turn in range(3):
    response = client.chat.completions.create(model="arl_jax", messages=messages, max_tokens=10,
                                              user="logprobs")
    messages += [response.choices[0].message.model_dump(exclude_unset=True),
                 {"role": "user", "content": f"Go on ({turn})."}]
  branch = _session(served, "logprobs")["branches"][-1]
  assert len(branch["completion_ids"]) > 30
  learner = _learner_logprobs(served, branch["prompt_ids"], branch["completion_ids"])
  sampled = np.array(branch["loss_mask"]) == 1
  np.testing.assert_allclose(np.array(branch["logprobs"])[sampled], learner[sampled], atol=1e-5)
  assert set(np.array(branch["versions"])[sampled]) == {0}


def test_top_logprobs_are_the_learner_s_most_likely_tokens(served, client):
  """`top_logprobs` (chat) and `logprobs=k` (completions) answer with the
  most likely tokens of the distribution each token was drawn from."""
  response = client.chat.completions.create(
      model="arl_jax", messages=QUESTION, max_tokens=8, logprobs=True, top_logprobs=4,
      extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
  prompt, tokens = response.model_extra["prompt_token_ids"], response.choices[0].model_extra[
      "token_ids"]
  learner = slots_lib.teacher_forced_distributions(served.graphdef, served.params,
                                                   [*prompt, *tokens])[len(prompt) - 1:-1]
  content = response.choices[0].logprobs.content
  assert [int(c.token.removeprefix("token_id:")) for c in content] == tokens
  for entry, row in zip(content, learner):
    top = entry.top_logprobs
    assert len(top) == 4
    ids = [int(t.token.removeprefix("token_id:")) for t in top]
    np.testing.assert_allclose([t.logprob for t in top], np.sort(row)[::-1][:4], atol=1e-5)
    np.testing.assert_allclose([row[i] for i in ids], [t.logprob for t in top], atol=1e-5)
    assert entry.logprob <= top[0].logprob + 1e-6
  legacy = client.completions.create(model="arl_jax", prompt="Add 12 and 7.", max_tokens=5,
                                     logprobs=2)
  logprobs = legacy.choices[0].logprobs
  for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
    assert 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob)
  with pytest.raises(openai.BadRequestError, match="records 5 alternatives"):
    client.chat.completions.create(model="arl_jax", messages=QUESTION, max_tokens=2,
                                   logprobs=True, top_logprobs=6)


def test_a_seed_repeats_its_choices_and_n_gives_different_ones(served, client):
  def ids(seed, n=1):
    response = client.chat.completions.create(model="arl_jax", messages=QUESTION, max_tokens=8,
                                              n=n, seed=seed,
                                              extra_body={"return_token_ids": True})
    return [c.model_extra["token_ids"] for c in response.choices]

  assert ids(7) == ids(7)
  three = ids(7, n=3)
  assert three[0] == ids(7)[0] and len({tuple(t) for t in three}) == 3
  assert ids(8) != ids(7)


def test_a_stop_string_cuts_the_answer_and_the_episode(served, client):
  free = client.chat.completions.create(model="arl_jax", messages=QUESTION, max_tokens=24, seed=3)
  text = free.choices[0].message.content
  stop = text[len(text) // 2:len(text) // 2 + 2]
  assert stop and text.find(stop) > 0
  cut = client.chat.completions.create(model="arl_jax", messages=QUESTION, max_tokens=24, seed=3,
                                       stop=[stop], user="stop",
                                       extra_body={"return_token_ids": True})
  assert cut.choices[0].message.content == text[:text.find(stop)]
  assert cut.choices[0].finish_reason == "stop"
  tokens = cut.choices[0].model_extra["token_ids"]
  tokenizer = served.tokenizer
  assert stop in tokenizer.detokenize(tokens) and stop not in tokenizer.detokenize(tokens[:-1])
  assert _session(served, "stop")["branches"][-1]["completion_ids"] == tokens


def test_streams_and_async_clients_share_the_engine(served):
  async def main():
    client = openai.AsyncOpenAI(base_url=served.base_url, api_key="unused")
    plain = [client.chat.completions.create(model="arl_jax", messages=QUESTION, max_tokens=6,
                                            n=2) for _ in range(6)]
    streams = [client.chat.completions.create(model="arl_jax", messages=QUESTION, max_tokens=6,
                                              stream=True, stream_options={"include_usage": True})
               for _ in range(4)]
    results = await asyncio.gather(*plain, *streams)
    chunks = []
    for stream in results[6:]:
      chunks.append([c async for c in stream])
    return results[:6], chunks

  plain, streams = asyncio.run(main())
  assert all(len(r.choices) == 2 for r in plain)
  for chunks in streams:
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens >= 1


def test_completions_take_text_or_token_ids(served, client):
  tokenizer = served.tokenizer
  text = client.completions.create(model="arl_jax", prompt="Add 12 and 7.", max_tokens=5,
                                   logprobs=0, extra_body={"return_token_ids": True})
  ids = tokenizer.encode("Add 12 and 7.")
  by_ids = client.completions.create(model="arl_jax", prompt=ids, max_tokens=5, seed=1)
  assert len(text.choices[0].logprobs.token_logprobs) == len(text.choices[0].model_extra[
      "token_ids"])
  assert text.choices[0].model_extra["prompt_token_ids"] == ids
  assert by_ids.choices[0].text == client.completions.create(
      model="arl_jax", prompt="Add 12 and 7.", max_tokens=5, seed=1).choices[0].text


def test_a_new_prompt_may_use_the_whole_max_model_len(served, client):
  """A prompt wider than the engine's prompt width (384 here) and below
  `max_model_len` (384 + 256) is served: the rest of it is an observation
  in the completion budget, so its log-probs see the whole prompt."""
  max_model_len = client.models.list().data[0].model_extra["max_model_len"]
  assert max_model_len == 640
  rng = np.random.default_rng(0)
  prompt = [int(t) for t in rng.integers(3, served.tokenizer.vocab_size, 500)]
  answer = client.completions.create(model="arl_jax", prompt=prompt, max_tokens=8, user="wide",
                                     extra_body={"return_token_ids": True})
  sampled = answer.choices[0].model_extra["token_ids"]
  assert answer.choices[0].model_extra["prompt_token_ids"] == prompt
  assert answer.usage.prompt_tokens == 500 and len(sampled) == answer.usage.completion_tokens
  branch = _session(served, "wide")["branches"][-1]
  assert branch["prompt_ids"] + branch["completion_ids"] == prompt + sampled
  assert branch["loss_mask"] == [0.0] * 116 + [1.0] * len(sampled)
  learner = _learner_logprobs(served, prompt, sampled)
  np.testing.assert_allclose(branch["logprobs"][116:], learner, atol=1e-5)
  with pytest.raises(openai.BadRequestError, match="maximum context length is 640"):
    client.completions.create(model="arl_jax", prompt=prompt + [5] * 140, max_tokens=1)
  with pytest.raises(openai.BadRequestError, match="maximum context length is 640"):
    client.completions.create(model="arl_jax", prompt=prompt, max_tokens=141)


def test_token_in_generate_continues_a_session_by_its_ids(served):
  """vLLM's /inference/v1/generate, as `renderers.client.generate` calls it."""
  url = served.base_url.removesuffix("/v1") + "/inference/v1/generate"
  tokenizer = served.tokenizer
  prompt = tokenizer.encode(tokenizer.template.format_chat(QUESTION))
  body = {"model": "arl_jax", "token_ids": prompt,
          "sampling_params": {"max_tokens": 8, "logprobs": 1, "skip_special_tokens": False,
                              "stop_token_ids": [tokenizer.eos_id]}}
  first = httpx.post(url, json=body, headers={"X-Session-ID": "ids"}).json()
  choice = first["choices"][0]
  assert [c["token"] for c in choice["logprobs"]["content"]] == [
      f"token_id:{t}" for t in choice["token_ids"]]
  more = tokenizer.encode("\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n")
  context = prompt + choice["token_ids"]
  second = httpx.post(url, json={**body, "token_ids": context + more},
                      headers={"X-Session-ID": "ids"}).json()
  assert second["prompt_token_ids"] == context + more
  branch = _session(served, "ids")["branches"][-1]
  assert branch["prompt_ids"] == prompt
  assert branch["completion_ids"] == choice["token_ids"] + more + second["choices"][0][
      "token_ids"]
  assert branch["loss_mask"][len(choice["token_ids"]):len(choice["token_ids"]) + len(more)] == [
      0.0] * len(more)


def test_a_stream_sends_the_answer_as_it_is_sampled(served, client):
  """Deltas arrive while the segment is sampled (more than one before the
  finish), and they add up to exactly the answer a seeded request without
  `stream` gets; a completion streams too."""
  kwargs = dict(model="arl_jax", messages=QUESTION, max_tokens=24, seed=11)
  whole = client.chat.completions.create(**kwargs).choices[0]
  chunks = list(client.chat.completions.create(stream=True, **kwargs))
  deltas = [c.choices[0].delta.content for c in chunks[1:-1] if c.choices[0].delta.content]
  assert len(deltas) > 1
  assert "".join(deltas) == whole.message.content
  assert chunks[-1].choices[0].finish_reason == whole.finish_reason
  text = dict(model="arl_jax", prompt="Add 12 and 7.", max_tokens=16, seed=5)
  plain = client.completions.create(**text).choices[0].text
  pieces = [c.choices[0].text for c in client.completions.create(stream=True, **text)]
  assert len([p for p in pieces if p]) > 1 and "".join(pieces) == plain


def test_a_refused_stream_is_an_error_object_and_a_left_stream_frees_its_slot(served, client):
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client.chat.completions.create(model="arl_jax", messages=QUESTION, stream=True,
                                   temperature=0.5)
  engine = served.server.engine
  with httpx.stream("POST", f"{served.base_url}/chat/completions", json={
      "model": "arl_jax", "messages": QUESTION, "max_tokens": 200, "stream": True}) as r:
    lines = r.iter_lines()
    assert "assistant" in next(lines)
    assert next(line for line in lines if '"content"' in line)  # (one delta, then leave)
  deadline = time.monotonic() + 10
  while ((served.server.port.open_segments or engine.active_slots)
         and time.monotonic() < deadline):
    time.sleep(0.05)
  assert served.server.port.open_segments == 0 and engine.active_slots == 0
