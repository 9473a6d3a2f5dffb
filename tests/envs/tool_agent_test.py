"""The tool_agent environment: tool answers, rewards, latency distribution."""

import time

import numpy as np
import pytest

from arl_jax.envs import env_api, tool_agent
from arl_jax.envs import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()
INSTANT = dict(latency_median_s=0.0, latency_p99_s=0.0)


def _env(**kwargs):
  return tool_agent.ToolAgentEnv(tool_agent.ToolAgentConfig(**{**INSTANT, **kwargs}), TOK)


def _ids(text, eos=False):
  return TOK.encode(text) + ([TOK.eos_id] if eos else [])


def test_splits_are_disjoint_and_cover_every_key():
  cfg = tool_agent.ToolAgentConfig(num_keys=200)
  train = {p.prompt_id for p in tool_agent.make_prompts(cfg, "train")}
  heldout = {p.prompt_id for p in tool_agent.make_prompts(cfg, "heldout")}
  assert not train & heldout and train | heldout == set(range(200))
  assert 5 <= len(heldout) <= 40


def test_the_tool_answers_a_call_and_the_episode_ends_at_eos():
  env = _env()
  prompt = tool_agent.make_prompts(env._cfg, "train")[0]  # noqa: SLF001
  assert env.multi_turn and env.stop_ids == (ord("]"),)
  call = _ids(f"[{prompt.prompt_id}]")
  assert TOK.decode(env.step(prompt, call)) == f"={prompt.answer};"
  assert TOK.decode(env.step(prompt, _ids("[x1]"))) == "=?;"  # a malformed key
  assert TOK.decode(env.step(prompt, _ids("[100000]"))) == "=?;"  # no such key
  assert TOK.decode(env.step(prompt, _ids("[\u00b2]"))) == "=?;"  # a non-ASCII digit
  assert env.step(prompt, _ids("12", eos=True)) is None
  # A third call exceeds max_calls=2: the episode ends.
  assert env.step(prompt, _ids("[1]=5;[2]=7;[3]")) is None


@pytest.mark.parametrize("completion,reward", [
    ("[{k}]={a};{a}", 1.0),  # the ideal episode
    ("[{k}]={a};{a}0", 0.0),  # wrong answer
    ("[{k}]={a};", 0.0),  # empty answer
    ("{a}", 1.0),  # answered without the tool (possible only by memorising)
    ("[{k}]=", 0.0),  # malformed
])
def test_reward_is_the_exact_value_after_the_last_observation(completion, reward):
  env = _env()
  prompt = tool_agent.make_prompts(env._cfg, "train")[3]  # noqa: SLF001
  text = completion.format(k=prompt.prompt_id, a=prompt.answer)
  assert env.score(prompt, _ids(text, eos=True)) == reward
  if reward:  # cut off by the length limit (no EOS): wrong even with the right digits
    assert env.score(prompt, _ids(text)) == 0.0


def test_demonstration_masks_the_observation_and_earns_full_reward():
  env = _env()
  prompt = tool_agent.make_prompts(env._cfg, "train")[0]  # noqa: SLF001
  demo = env.demonstration(prompt)
  text = TOK.decode(demo.completion_ids)
  assert text == f"[{prompt.prompt_id}]={prompt.answer};{prompt.answer}"
  observed = [m == 0.0 for m in demo.loss_mask]
  n_call = len(f"[{prompt.prompt_id}]")
  assert observed == [False] * n_call + [True] * (len(prompt.answer) + 2) + \
      [False] * (len(prompt.answer) + 1)
  assert env.score(prompt, demo.completion_ids) == 1.0


def test_latency_quantiles_match_the_configured_ones():
  latency = tool_agent.LognormalLatency(median_s=0.2, p99_s=5.0, max_s=60.0, seed=1)
  draws = latency.sample(200_000)
  for q in (0.1, 0.5, 0.9, 0.99):
    np.testing.assert_allclose(np.quantile(draws, q), latency.quantile(q), rtol=0.05)
  assert latency.quantile(0.5) == pytest.approx(0.2)
  assert latency.quantile(0.99) == pytest.approx(5.0)
  capped = tool_agent.LognormalLatency(median_s=0.2, p99_s=5.0, max_s=1.0, seed=1)
  assert capped.sample(10_000).max() == 1.0 and capped.quantile(0.99) == 1.0


def test_a_tool_call_waits_for_its_latency_and_evaluation_does_not():
  cfg = tool_agent.ToolAgentConfig(latency_median_s=0.2, latency_p99_s=0.2, latency_max_s=1.0)
  prompt = tool_agent.make_prompts(cfg, "train")[0]
  for for_eval, low, high in ((False, 0.19, 0.6), (True, 0.0, 0.05)):
    env = tool_agent.ToolAgentEnv(cfg, TOK, for_eval=for_eval)
    start = time.monotonic()
    env.step(prompt, _ids("[1]"))
    assert low <= time.monotonic() - start <= high


def test_bad_settings_name_the_key():
  with pytest.raises(ValueError, match="env.latency_p99_s"):
    tool_agent.ToolAgentConfig(latency_median_s=1.0, latency_p99_s=0.5)
  with pytest.raises(ValueError, match="env.max_calls"):
    tool_agent.ToolAgentConfig(max_calls=0)


def _chat_env(tokenizer_path):
  from arl_jax.envs import hf_tokenizer
  tok = hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="</s>", chat_template="chatml")
  return tool_agent.ToolAgentEnv(tool_agent.ToolAgentConfig(**INSTANT), tok), tok


def test_chat_template_protocol_uses_turns(tokenizer_path):
  """With chatml the call ends the assistant's turn, the tool answers in a
  `tool` turn, and the answer is the last assistant turn."""
  env, tok = _chat_env(tokenizer_path)
  eot = tok.end_of_turn_id
  assert env.stop_ids == () and env.multi_turn
  assert env_api.segment_stop_ids(tok, env, None) == (tok.eos_id, eot)
  prompt = tool_agent.make_prompts(env._cfg, "train")[2]  # noqa: SLF001
  assert tok.decode(env.encode_prompt(prompt)) == f"user\n{prompt.text}\nassistant\n"
  call = [*tok.encode(f"[{prompt.prompt_id}]"), eot]
  observation = env.step(prompt, call)
  assert observation == tok.encode(
      f"\n<|im_start|>tool\n={prompt.answer};<|im_end|>\n<|im_start|>assistant\n")
  answer = [*tok.encode(prompt.answer), eot]
  episode = [*call, *observation, *answer]
  assert env.step(prompt, episode) is None  # an answer turn ends the episode
  assert env.score(prompt, episode) == 1.0
  assert env.score(prompt, episode[:-1]) == 0.0  # cut off before the end of turn
  wrong = [*call, *observation, *tok.encode(prompt.answer + "1"), eot]
  assert env.score(prompt, wrong) == 0.0
  assert env.score(prompt, [*call, *observation, eot]) == 0.0  # empty answer
  assert env.score(prompt, [*call, eot]) == 0.0  # a call is not an answer
  # Malformed calls get "?"; a third call exceeds max_calls=2.
  bad = env.step(prompt, [*tok.encode("[x1]"), eot])
  assert tok.decode(bad).endswith("=?;\nassistant\n")
  two = [*call, *observation, *call, *observation]
  assert env.step(prompt, [*two, *call]) is None
  assert env.step(prompt, [*call[:-1], tok.eos_id]) is None  # EOS ends it
  demo = env.demonstration(prompt)
  assert demo.completion_ids == tuple(episode)
  assert env.score(prompt, demo.completion_ids) == 1.0
  assert sum(m == 0.0 for m in demo.loss_mask) == len(observation)
