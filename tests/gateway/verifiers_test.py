"""An environment of the `verifiers` package (0.4, its v1 API) run unchanged
against the gateway, with verifiers' own machinery: its env and rollout code,
its interception server, the `null` and `bash` harnesses' chat program (a
separate process talking OpenAI chat completions, streamed), and both of its
clients: the eval client relays those requests to `/v1/chat/completions`, the
train client renders them to token ids itself and calls vLLM's
`/inference/v1/generate`. Every rollout sends its trace id as `X-Session-ID`,
so each is one gateway session, and what verifiers recorded (messages, usage,
token ids, log-probs) is compared with what the session holds.

The chat program is a PEP 723 script that verifiers provisions with uv from
the network; this venv already holds its dependencies, so `_provisioned`
registers it as prepared with this interpreter. Nothing else is replaced.
"""

import asyncio
import hashlib
import sys
import types

import httpx
import numpy as np
import pytest

pytest.importorskip("verifiers")
pytest.importorskip("fastapi")

import renderers  # noqa: E402 - (a dependency of verifiers)
import verifiers.v1 as vf  # noqa: E402
from verifiers.v1 import clients as vf_clients  # noqa: E402
from verifiers.v1 import dialects as vf_dialects  # noqa: E402
from verifiers.v1.harnesses.utils import launch as vf_launch  # noqa: E402
from verifiers.v1.runtimes import subprocess as vf_subprocess  # noqa: E402

from arl_jax.testing import served as served_lib  # noqa: E402
from tests.gateway import scripted  # noqa: E402

# verifiers imports a taskset by its id, as a module exporting it in `__all__`.
TASKSET_ID = "arl_jax_verifiers_probe"
QUESTIONS = ["What is the weather in Paris?", "Is it sunny in Paris?"]
CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "echo sunny"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."


class Question(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
  """A prompt and a reward that reads the rollout's final answer."""

  @vf.reward
  async def answered(self, task, trace) -> float:
    return float(bool(trace.messages[-1].content))


class Questions(vf.Taskset[Question, vf.TasksetConfig]):
  def load(self):
    for question in QUESTIONS:
      yield Question(vf.TaskData(prompt=question), self.config.task)


class FollowUp(vf.Env[vf.SingleAgentEnvConfig]):
  """Two user turns: the task's question, then a follow-up. Each turn
  relaunches the harness program on the whole conversation (`resume`)."""

  async def run(self, task, agents):
    async with agents.agent.interaction(task) as chat:
      await chat.turn()
      await chat.turn("And tomorrow?")


# One event loop for every verifiers call of this module: its train client
# keeps asyncio locks across calls (bound to the first loop that used them),
# so a second `asyncio.run` would meet a lock of a closed loop.
_LOOP = asyncio.new_event_loop()

@pytest.fixture(autouse=True)
def _provisioned(tmp_path, monkeypatch):
  """The taskset importable by its id, and the chat program as a prepared uv
  script (its content-addressed path, run by this venv's interpreter)."""
  module = types.ModuleType(TASKSET_ID)
  module.Questions, module.__all__ = Questions, ["Questions"]
  monkeypatch.setitem(sys.modules, TASKSET_ID, module)
  runtime = vf_subprocess.SubprocessRuntime
  monkeypatch.setattr(runtime, "scripts_dir", str(tmp_path))
  source = vf_launch.CHAT_PROGRAM_SOURCE
  path = tmp_path / f"{hashlib.sha256(source.encode()).hexdigest()}.py"
  path.write_text(source)
  monkeypatch.setitem(runtime._interpreters, str(path), sys.executable)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  s = served_lib.start_tiny(str(tmp_path_factory.mktemp("tok")))
  yield s
  s.server.stop()


def _script(context: str) -> str:
  """A model that runs `echo sunny` with the bash tool, then answers."""
  last = context.rsplit("<|im_start|>", 2)[-2]
  return ANSWER + "<|im_end|>" if "<tool_response>" in last else CALL + "<|im_end|>"


@pytest.fixture(scope="module")
def tool_gateway(tmp_path_factory):
  """The gateway over a scripted engine (the random tiny model never calls a
  tool), its context large enough for the bash harness's tool schemas."""
  folder = str(tmp_path_factory.mktemp("tok"))
  tokenizer = served_lib.chat_tokenizer(folder)
  http, gateway, _ = scripted.start(tokenizer, _script, prompt_len=2048)
  yield http, gateway, tokenizer, folder
  http.stop()


def _client(kind: str, base_url: str, folder: str, **renderer) -> vf.ClientConfig:
  if kind == "eval":
    return vf.EvalClientConfig(base_url=base_url, api_key_var="ARL_JAX_UNSET_KEY")
  # The train client tokenizes with the model's own tokenizer folder.
  return vf.TrainClientConfig(base_url=base_url, api_key_var="ARL_JAX_UNSET_KEY",
                              renderer_model_name=folder,
                              renderer=renderers.DefaultRendererConfig(**renderer))


def _run(env: vf.Env, client: vf.ClientConfig, **sampling) -> list[vf.Episode]:
  """Every task once, as verifiers' eval runner runs them: in the env's
  serving resources, one `run_slot` per rollout, all at once."""
  ctx = vf.ModelContext(model="arl_jax", client=client, sampling=vf.Sampling(**sampling))

  async def main():
    async with env.serving():
      slots = [slot for task in env.taskset for slot in env.slots(task)]
      return await asyncio.gather(*(env.run_slot(slot, ctx) for slot in slots))

  episodes = _LOOP.run_until_complete(main())
  for episode in episodes:
    assert episode.ok, episode.errors
    assert all(trace.ok for trace in episode.traces), [t.errors for t in episode.traces]
  return episodes


def _env(harness: dict, env_cls=None) -> vf.Env:
  config = vf.SingleAgentEnvConfig(
      taskset=vf.TasksetConfig(id=TASKSET_ID),
      agent=vf.AgentConfig(harness=harness, runtime=vf.SubprocessConfig()))
  return env_cls(config) if env_cls else vf.load_environment(config)


def _session(base_url: str, trace) -> dict:
  return httpx.get(f"{base_url}/sessions/{trace.id}").json()


def _sampled_spans(branch: dict) -> list[list[int]]:
  """The session branch's sampled completions, one list of ids per turn."""
  spans, last = [], 0.0
  for token, mask in zip(branch["completion_ids"], branch["loss_mask"]):
    if mask == 1.0 and last != 1.0:
      spans.append([])
    if mask == 1.0:
      spans[-1].append(token)
    last = mask
  return spans


def test_eval_client_turns_are_one_session_that_extends_exactly(served):
  """Streamed chat completions, relayed: the follow-up continues the
  session's tokens (no break), and what verifiers recorded of each call (its
  usage, its answer) is what the session sampled."""
  episodes = _run(_env({"id": "null"}, FollowUp), _client("eval", served.base_url, ""),
                  max_tokens=12)
  for trace in (t for episode in episodes for t in episode.traces):
    assert trace.rewards["answered"].score == 1.0 and len(trace.calls) == 2
    session = _session(served.base_url, trace)
    assert session["turns"] == 2 and session["breaks"] == 0
    branch = session["branches"][-1]
    spans = _sampled_spans(branch)
    answers = [m.content for m in trace.messages if m.role == "assistant"]
    assert [len(s) for s in spans] == [c.usage.completion_tokens for c in trace.calls]
    assert [served.tokenizer.detokenize(s) for s in spans] == answers
    assert trace.calls[-1].usage.prompt_tokens == (
        len(branch["prompt_ids"]) + len(branch["completion_ids"]) - len(spans[-1]))


def test_train_client_tokens_and_log_probs_are_the_session_s(served):
  """Token-in generation: the token ids and behaviour log-probs verifiers
  keeps for training are the ones the gateway recorded."""
  episodes = _run(_env({"id": "null"}), _client("train", served.base_url, served.folder),
                  max_tokens=12)
  for trace in (t for episode in episodes for t in episode.traces):
    assert trace.calls[0].usage.completion_tokens == 12
    (branch,) = trace.branches
    (recorded,) = _session(served.base_url, trace)["branches"]
    assert branch.token_ids == recorded["prompt_ids"] + recorded["completion_ids"]
    sampled = np.array(branch.sampled_mask)
    assert sampled.sum() == 12 and (recorded["loss_mask"] == [1.0] * 12)
    assert np.array(branch.logprobs)[sampled].tolist() == recorded["logprobs"]


def test_a_sampling_setting_the_sampler_cannot_honour_is_refused(served):
  """verifiers' train client forwards its sampling config verbatim as vLLM's
  `sampling_params`; a penalty there is refused (as on chat completions)
  rather than dropped, and its neutral value is accepted."""
  client = vf_clients.TrainClient(_client("train", served.base_url, served.folder))
  body = {"model": "arl_jax", "messages": [{"role": "user", "content": QUESTIONS[0]}]}

  async def respond(**sampling):
    return await client.get_response(vf_dialects.ChatDialect(), body,
                                     vf.Sampling(max_tokens=4, **sampling))

  async def main():
    try:
      assert len((await respond(repetition_penalty=1.0)).tokens.completion_ids) == 4
      with pytest.raises(vf.ProviderError, match="repetition_penalty: only 1.0"):
        await respond(repetition_penalty=1.1)
    finally:
      await client.close()

  _LOOP.run_until_complete(main())


@pytest.mark.parametrize("kind", ["eval", "train"])
def test_a_bash_tool_loop_is_one_session(tool_gateway, kind):
  """verifiers' bash harness: the model's call runs (`echo sunny`), its result
  goes back as a tool message, the model answers; the gateway served both
  turns as one exact episode."""
  http, gateway, tokenizer, folder = tool_gateway
  episodes = _run(_env({"id": "bash"}), _client(kind, http.base_url, folder,
                                                 tool_parser="qwen3"))
  for trace in (t for episode in episodes for t in episode.traces):
    assistant, tool, answer = trace.messages[-3:]
    assert [c.name for c in assistant.tool_calls] == ["bash"]
    assert tool.role == "tool" and tool.content.strip() == "sunny"
    assert answer.content == ANSWER and len(trace.calls) == 2
    session = _session(http.base_url, trace)
    assert session["turns"] == 2 and session["breaks"] == 0
    branch = session["branches"][-1]
    assert _sampled_spans(branch) == [tokenizer.encode(CALL + "<|im_end|>"),
                                      tokenizer.encode(ANSWER + "<|im_end|>")]
    if kind == "train":
      (kept,) = trace.branches
      assert kept.token_ids == branch["prompt_ids"] + branch["completion_ids"]
