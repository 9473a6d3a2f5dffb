"""A run whose rollouts are an OpenAI-client agent's (`configs/openai_agent.py`):
trained rows are the tokens the agent's sessions sampled, tool answers
masked, versions and lag within the bound; the agent's faults are counted;
a bad `agent.function` is refused by name before anything is built."""

import json

import pytest

from arl_jax.config import run_spec
from arl_jax.testing import tiny, tool_rows
from arl_jax.training import run_lib

pytest.importorskip("fastapi")


def test_an_openai_agent_trains_through_the_gateway(tmp_path):
  config = tiny.load_config("openai_agent", "tiny")
  config.num_steps = 8
  config.eval_every = 0
  # Tools slower than a tiny update: sessions outlive weight updates.
  config.env.update(latency_median_s=0.2, latency_p99_s=0.6, latency_max_s=1.0)
  result = run_lib.run(config, str(tmp_path), print_fn=lambda _: None, keep_batches=True)
  observed_rows = lagged_rows = 0
  for b in result.trained_batches:
    # The agent's tool answers ("=482;") are masked observations after a "]"
    # the policy sampled, exactly as the built-in environment's are.
    observed, _ = tool_rows.check_batch(b, prompt_len=config.sampler.prompt_len,
                                        max_lag=config.orchestrator.max_off_policy_steps)
    observed_rows += observed
    lagged_rows += int((b["lag"] > 0).sum())
  assert observed_rows > 0 and lagged_rows > 0  # (async: trained behind the sampler)
  steps = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  last = [s for s in steps if "agent_sessions" in s][-1]
  assert last["agent_sessions"] >= last["agent_rollouts"] > 0
  assert last["env_turns"] > last["agent_rollouts"]  # multi-turn sessions


def test_a_bad_agent_function_is_refused_by_name():
  config = tiny.load_config("openai_agent", "tiny")
  for function, says in (("no_colon", "expected 'package.module:name'"),
                         ("arl_jax.envs.arith:nothing", "has no callable 'nothing'"),
                         ("no/such/file.py:agent", "no file"),
                         ("arl_jax.envs.env_api:ended_turn", "must take the keyword")):
    config.agent.function = function
    with pytest.raises(run_spec.ConfigError, match="agent.function") as e:
      run_spec.resolve(config)
    assert says in str(e.value)
