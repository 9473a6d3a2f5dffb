"""`AgentRunner` over a scripted engine: a group's rollouts are the sessions'
exact tokens with the agents' rewards; agent faults are counted rollouts of
reward 0, never crashes; a cancelled group's agents stop and their next
request gets a 409; a restored group calls agents only for what was not done."""

import asyncio
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from arl_jax.core import episode as episode_lib
from arl_jax.core import group_request
from arl_jax.envs import env_api
from arl_jax.gateway import agent_runner
from arl_jax.testing import served
from tests.gateway import scripted

pytest.importorskip("fastapi")


def _script(context: str):
  last = context.rsplit("<|im_start|>", 2)[-2]
  if "hold" in last:
    return None  # never ends until cancelled
  if "<tool_response>" in last:
    return "The value is 42.<|im_end|>"
  return "Let me look.<|im_end|>"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
  tokenizer = served.chat_tokenizer(str(tmp_path_factory.mktemp("tok")))
  http, gateway, engine = scripted.start(tokenizer, _script)
  yield http, gateway, engine
  http.stop()


def _request(group_id: int, text: str, group_size: int) -> group_request.GroupRequest:
  return group_request.GroupRequest(
      group_id=group_id, prompt=env_api.TextPrompt(prompt_id=group_id, text=text, answer="42"),
      prompt_ids=(1, 2, 3), dispatch_version=5, group_size=group_size, dispatch_time=0.0)


async def two_turns(*, base_url, model, prompt, api_key):
  """A user's agent: asks, answers a (pretend) tool turn, scores the answer."""
  client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
  messages = [{"role": "user", "content": prompt.text}]
  seen = []
  async with client:
    for _ in range(2):
      r = await client.chat.completions.create(model=model, messages=messages,
                                               extra_body={"return_token_ids": True})
      seen.append((r.prompt_token_ids, r.choices[0].token_ids))
      messages.append({"role": "assistant", "content": r.choices[0].message.content})
      messages.append({"role": "tool", "content": "42"})
  two_turns.seen[prompt.prompt_id] = seen
  return float("42" in messages[-2]["content"])


two_turns.seen = {}


def _runner(gateway, agent, groups, **kwargs):
  _, gw, _ = gateway
  http = gateway[0]
  done = []
  queue = list(groups)

  def take(timeout):
    time.sleep(min(timeout, 0.01))
    return [queue.pop(0)] if queue else []

  runner = agent_runner.AgentRunner(
      agent, gateway=gw, root_url_fn=lambda: http.base_url[:-3], model="arl_jax",
      on_group_fn=done.append, optional_args=("api_key",) if "api_key" in
      agent.__code__.co_varnames else (), **kwargs)
  return runner, take, done


def _wait(predicate, timeout=20.0):
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


def test_a_group_is_its_sessions_exact_tokens_with_the_agents_rewards(gateway):
  runner, take, done = _runner(gateway, two_turns, [_request(1, "k1?", 3)])
  runner.start(take)
  try:
    _wait(lambda: done)
  finally:
    runner.close()
  group = done[0]
  assert group.group_id == 1 and group.dispatch_version == 5
  assert [r.sample_index for r in group.rollouts] == [0, 1, 2]
  (first_prompt, first), (second_prompt, second) = two_turns.seen[1]
  for r in group.rollouts:
    assert r.reward == 1.0 and r.finish_reason == "stop"
    # The prompt the engine sampled after, then turn 1, the tool turn, turn 2.
    assert r.prompt_ids.tolist() == first_prompt
    context = [*first_prompt, *r.completion_ids.tolist()]
    assert context[:len(second_prompt)] == second_prompt  # turn 2 extends turn 1 exactly
    assert context[len(second_prompt):] == second
    sampled = r.loss_mask > 0
    assert sampled.sum() == len(first) + len(second)
    assert r.completion_ids[:len(first)].tolist() == first
    np.testing.assert_allclose(r.behaviour_logprobs[sampled], scripted.LOGPROB)
    assert np.all(r.token_versions[~sampled] == -1) and np.all(r.behaviour_logprobs[~sampled] == 0)
  metrics = runner.metrics()
  assert metrics["agent_sessions"] == 3 and metrics["env_turns"] == 6
  assert metrics["env_errors"] == 0 and metrics["agent_session_breaks"] == 0
  assert len(gateway[1].sessions) == 0  # (a done rollout's session is gone)


async def raises(*, base_url, model, prompt):
  raise RuntimeError("the agent crashed")


async def says_nan(*, base_url, model, prompt):
  await two_turns(base_url=base_url, model=model, prompt=prompt, api_key="x")
  return float("nan")


async def never_asks(*, base_url, model, prompt):
  return 1.0


async def too_slow(*, base_url, model, prompt):
  await asyncio.sleep(30)


def sync_agent(*, base_url, model, prompt):
  """A plain (sync) agent with no reward of its own: the session's POSTed one."""
  client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
  client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
  root, _, rest = base_url.partition("/sessions/")
  httpx.post(f"{root}/v1/sessions/{rest.split('/')[0]}/reward", json={"reward": 0.5})


@pytest.mark.parametrize("agent,why", [(raises, "the agent crashed"), (says_nan, "not finite"),
                                       (never_asks, "no request"), (too_slow, "timeout")])
def test_agent_faults_are_counted_rollouts_of_reward_zero(gateway, agent, why):
  printed = []
  runner, take, done = _runner(gateway, agent, [_request(2, "k2?", 2)], timeout_s=1.0,
                               print_fn=printed.append)
  runner.start(take)
  try:
    _wait(lambda: done)
  finally:
    runner.close()
  assert [r.finish_reason for r in done[0].rollouts] == ["error", "error"]
  assert [r.reward for r in done[0].rollouts] == [0.0, 0.0]
  metrics = runner.metrics()
  assert metrics["env_errors"] == 2
  assert metrics["env_timeouts"] == (2 if why == "timeout" else 0)
  assert all(why in line for line in printed) and len(printed) == 2


def test_a_sync_agent_may_post_its_reward_to_its_session(gateway):
  runner, take, done = _runner(gateway, sync_agent, [_request(3, "k3?", 2)])
  runner.start(take)
  try:
    _wait(lambda: done)
  finally:
    runner.close()
  assert [r.reward for r in done[0].rollouts] == [0.5, 0.5]
  assert [r.finish_reason for r in done[0].rollouts] == ["stop", "stop"]


def test_a_cancelled_group_stops_and_its_agents_next_request_is_refused(gateway):
  _, gw, engine = gateway
  outcome = {}
  asked = threading.Event()
  go_on = threading.Event()

  def held_agent(*, base_url, model, prompt):
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "one"}]
    client.chat.completions.create(model=model, messages=messages)
    asked.set()
    try:  # a segment that never ends: the cancellation stops it
      client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hold"}])
    except openai.APIStatusError as e:
      outcome["held"] = e.status_code
    go_on.wait(10)
    try:
      client.chat.completions.create(model=model, messages=messages)
    except openai.APIStatusError as e:
      outcome["next"] = (e.status_code, e.code, str(e))
    return 1.0

  runner, take, done = _runner(gateway, held_agent, [_request(4, "k4?", 1)])
  runner.start(take)
  try:
    assert asked.wait(10)
    _wait(lambda: engine.held)  # its segment is in the engine
    held = set(engine.held)
    runner.cancel([4])
    assert held <= set(engine.cancelled) and not engine.held  # freed at once
    _wait(lambda: "held" in outcome)
    go_on.set()
    _wait(lambda: "next" in outcome)
  finally:
    runner.close()
  assert outcome["held"] == 409
  status, code, text = outcome["next"]
  assert (status, code) == (409, "session_cancelled"), text
  time.sleep(0.1)
  assert done == [] and runner.metrics()["agent_cancelled_rollouts"] == 1


def test_a_restored_group_calls_agents_only_for_rollouts_not_done(gateway):
  calls = []

  async def counted(*, base_url, model, prompt):
    calls.append(prompt.prompt_id)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    async with client:
      await client.chat.completions.create(model=model,
                                           messages=[{"role": "user", "content": "hi"}])
    return 0.25

  request = _request(6, "k6?", 3)
  saved = episode_lib.Episode(request=request, sample_index=1, completion_ids=[7, 8],
                              loss_mask=[1.0, 1.0], logprobs=[-0.5, -0.5],
                              versions=[3, 3]).to_rollout(finish_reason="stop", reward=1.0)
  runner, take, done = _runner(gateway, counted, [])
  runner.restore([saved], [episode_lib.Episode(request=request, sample_index=i)
                           for i in (0, 2)])
  runner.start(take)
  try:
    _wait(lambda: done)
  finally:
    runner.close()
  assert calls == [6, 6]
  assert [r.reward for r in done[0].rollouts] == [0.25, 1.0, 0.25]
  assert done[0].rollouts[1] is saved
