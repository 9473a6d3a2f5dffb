"""An agent written as users write them (an `openai` client, `tools`, a loop
that runs each call and sends its result) against the gateway, over a
scripted model that calls a tool and then answers: its calls are parsed into
`tool_calls`, each turn extends the last one's exact tokens, and the
session's episode is the conversation the model saw, observations masked."""

import json

import httpx
import openai
import pytest

from arl_jax.testing import served
from tests.gateway import scripted

pytest.importorskip("fastapi")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _script(context: str) -> str:
  """Calls the tool for a question, answers after a tool result."""
  last = context.rsplit("<|im_start|>", 2)[-2]
  if "<tool_response>" in last:
    return "It is sunny in Paris.<|im_end|>"
  if "malformed" in last:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call><|im_end|>'
  return CALL + "<|im_end|>"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
  tokenizer = served.chat_tokenizer(str(tmp_path_factory.mktemp("tok")))
  http, gateway, engine = scripted.start(tokenizer, _script)
  yield http, gateway, engine, tokenizer
  http.stop()


def get_weather(city: str) -> str:
  return json.dumps({"city": city, "sky": "sunny"})


def _agent(client, question: str, session: str) -> tuple[list, str]:
  """A plain multi-turn agent loop: call tools until the model answers."""
  messages = [{"role": "user", "content": question}]
  for _ in range(4):
    response = client.chat.completions.create(
        model="arl_jax", messages=messages, tools=TOOLS, extra_headers={"X-Session-ID": session},
        extra_body={"return_token_ids": True})
    message = response.choices[0].message
    messages.append(message.model_dump(exclude_unset=True))
    if not message.tool_calls:
      return messages, response.choices[0].finish_reason
    assert response.choices[0].finish_reason == "tool_calls"
    for call in message.tool_calls:
      result = get_weather(**json.loads(call.function.arguments))
      messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
  raise AssertionError("the agent did not finish")


def test_a_tool_loop_yields_one_episode_of_the_exact_conversation(gateway):
  http, gw, _, tokenizer = gateway
  client = openai.OpenAI(base_url=http.base_url, api_key="unused")
  messages, finish = _agent(client, "What is the weather in Paris?", "tool-loop")
  assert finish == "stop"
  call = messages[1]["tool_calls"][0]
  assert call["function"]["name"] == "get_weather"
  assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
  assert messages[1]["content"] is None
  assert messages[3]["content"] == "It is sunny in Paris."

  session = httpx.get(http.base_url + "/sessions/tool-loop").json()
  assert session["turns"] == 2 and session["breaks"] == 0
  last = session["branches"][-1]
  prompt, completion = last["prompt_ids"], last["completion_ids"]
  mask = last["loss_mask"]
  # The model's two answers are trained on; the tool result between them is not.
  sampled = [t for t, m in zip(completion, mask) if m == 1.0]
  observed = [t for t, m in zip(completion, mask) if m == 0.0]
  assert sampled == tokenizer.encode(CALL + "<|im_end|>" + "It is sunny in Paris.<|im_end|>")
  assert tokenizer.detokenize(observed, skip_special_tokens=False) == (
      "\n<|im_start|>user\n<tool_response>\n" + get_weather("Paris")
      + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
  assert all(lp == scripted.LOGPROB for lp, m in zip(last["logprobs"], mask) if m == 1.0)
  assert all(v == 0 for v, m in zip(last["versions"], mask) if m == 1.0)
  assert all(v < 0 for v, m in zip(last["versions"], mask) if m == 0.0)
  # Here the model wrote its call as the template writes it, so the whole
  # context is also what the template renders for the whole conversation.
  whole = tokenizer.template.format_chat(
      [messages[0], {**messages[1], "tool_calls": [
          {**call, "function": {**call["function"], "arguments": {"city": "Paris"}}}]},
       messages[2], messages[3]], add_generation_prompt=False, tools=TOOLS)
  assert prompt + completion == tokenizer.encode(whole)[:-1]  # (the template's last "\n")
  assert gw.counters["tool_call_parse_failures"] == 0


def test_a_malformed_call_comes_back_as_text_and_is_counted(gateway):
  http, gw, _, _ = gateway
  client = openai.OpenAI(base_url=http.base_url, api_key="unused")
  before = gw.counters["tool_call_parse_failures"]
  response = client.chat.completions.create(
      model="arl_jax", messages=[{"role": "user", "content": "malformed please"}], tools=TOOLS)
  choice = response.choices[0]
  assert choice.message.tool_calls is None and choice.finish_reason == "stop"
  assert '"arguments": {"city": ' in choice.message.content
  assert gw.counters["tool_call_parse_failures"] == before + 1


def test_a_streamed_tool_call_arrives_as_a_tool_calls_delta(gateway):
  http, _, _, _ = gateway
  client = openai.OpenAI(base_url=http.base_url, api_key="unused")
  chunks = list(client.chat.completions.create(
      model="arl_jax", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
      stream=True))
  calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
  assert [c.function.name for c in calls] == ["get_weather"]
  assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def _async_agent(base_url, i):
  client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
  messages = [{"role": "user", "content": f"Weather, agent {i}?"}]
  for _ in range(3):
    response = await client.chat.completions.create(
        model="arl_jax", messages=messages, tools=TOOLS, user=f"async-{i}")
    message = response.choices[0].message
    messages.append(message.model_dump(exclude_unset=True))
    if not message.tool_calls:
      return messages
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny"}
                 for c in message.tool_calls]
  raise AssertionError("no answer")


def test_concurrent_async_agents_keep_their_sessions_apart(gateway):
  import asyncio
  http, gw, _, _ = gateway

  async def main():
    return await asyncio.gather(*(_async_agent(http.base_url, i) for i in range(8)))

  results = asyncio.run(main())
  assert all(m[-1]["content"] == "It is sunny in Paris." for m in results)
  for i in range(8):
    session = gw.sessions.get(f"async-{i}", create=False)
    assert session.turns == 2 and session.breaks == 0
