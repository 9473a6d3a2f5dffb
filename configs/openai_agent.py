r"""Training an agent written against the OpenAI API: the `tool_agent` task, as a user's agent.

Command:

  python -m arl_jax.launch --config=configs/openai_agent.py --workdir=/tmp/openai_agent

`lookup_agent` below is all a user writes: an async function that gets a
base URL, a model name and the prompt record, talks to the model only
through `openai.AsyncOpenAI` (here the completions API, since this model has
no chat template; a chat model's agent uses `chat.completions` with
`tools`), runs its tool, and returns the reward. `agent.function` names it;
the run serves its own sampler engine on 127.0.0.1 (`arl_jax/gateway`),
gives each rollout a session of its own (`.../sessions/ID/v1`), and trains
on exactly the tokens the engine sampled, each with its behaviour log-prob
and version, the tool's answers masked. Groups too stale to train are
cancelled: their agents' next requests get a 409, and their tasks stop.

The task, model and schedule are `configs/tool_agent.py`'s (the agent
sends the same tokens the built-in environment does: `k37?` -> `[37]` ->
`=482;` -> `482<eos>`), so the two configs' runs compare the gateway path
with the in-process one (`benchmarks/agent_gateway.py`).

Variants (the `:ARG` after the file name):
  (none)  configs/tool_agent.py's default run, through the gateway.
  tiny    a few steps of a tiny model, for tests (seconds).
"""

import asyncio

import ml_collections

from arl_jax.config import builtin


async def lookup_agent(*, base_url, model, prompt, api_key, env, http_client):
  """One episode of the lookup task (env: the run's `ToolAgentEnv`, for its
  tool; http_client: the agents' shared connection pool)."""
  import openai  # noqa: PLC0415 - the [serve] extra; imported where the agent runs

  client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client,
                              max_retries=0)
  text = prompt.text  # e.g. "k37?"
  # (No `async with client`: closing it would close the shared pool.)
  for calls in range(env.max_calls + 1):
    # The stop token `]` ends a tool call (the engine stops on it); keep it
    # in the text so the next prompt extends these exact tokens.
    try:
      out = (await client.completions.create(
          model=model, prompt=text,
          extra_body={"include_stop_str_in_output": True})).choices[0]
    except openai.BadRequestError as e:
      if e.code == "context_length_exceeded":
        return 0.0  # the tool's answer left no room for one: the episode ran out
      raise
    text += out.text
    if out.finish_reason != "stop" or not out.text.endswith("]"):
      # The answer: right when the episode ended on EOS with the value.
      return float(out.finish_reason == "stop" and out.text.strip() == prompt.answer)
    if calls == env.max_calls:
      return 0.0  # a call past the tool budget is left unanswered
    key = text[text.rfind("[") + 1:-1]
    text += f"={await asyncio.to_thread(env.lookup, key)};"  # the tool (it takes a while)
  return 0.0


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = "tiny" if arg == "tiny" else None
  if arg not in (None, "", "tiny"):
    raise ValueError(f"configs/openai_agent.py: unknown variant {arg!r}; use '' or 'tiny'")
  config = builtin.load("tool_agent", variant)
  config.unlock()
  config.agent = ml_collections.ConfigDict(dict(
      function=f"{__file__}:lookup_agent",
      # As the environment's own calls: a rollout past it is an error.
      timeout_s=60.0))
  config.lock()
  return config
