"""Several environments in one run, chosen per prompt."""

import json
import os

import numpy as np
import pytest

from arl_jax.config import run_spec
from arl_jax.envs import env_api, mixture, prompt_data, prompt_source, registry
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.testing import tiny
from arl_jax.training import run_lib


def _mixture_cfg(**components):
  return mixture.MixtureConfig(components=components or dict(
      arith=dict(weight=3.0, max_operand=9), tool_agent=dict(weight=1.0, num_keys=40)))


def test_prompts_and_calls_are_routed_to_their_environment():
  cfg = _mixture_cfg()
  env = registry.ENVS["mixture"].make_env_fn(cfg, tokenizer_lib.ByteTokenizer())
  prompts = registry.ENVS["mixture"].make_prompts_fn(cfg, "train")
  assert {p.env for p in prompts} == {"arith", "tool_agent"}
  assert env.multi_turn and env.stop_ids == env.envs["tool_agent"].stop_ids
  for p in prompts[:3] + prompts[-3:]:
    sub = env.envs[p.env]
    assert env.env_name_of(p) == p.env
    assert env.encode_prompt(p) == sub.encode_prompt(p.prompt)
    demo = env.demonstration(p).completion_ids
    if p.env == "arith":  # single-turn: no observation, scored directly
      assert env.step(p, list(demo)) is None
      assert env.score(p, list(demo)) == 1.0
    # Stop tokens stay per environment: `]` ends tool_agent segments only.
    tok = tokenizer_lib.ByteTokenizer()
    want = (tok.eos_id, ord("]")) if p.env == "tool_agent" else (tok.eos_id,)
    assert env_api.segment_stop_ids(tok, env, p) == want
  assert env_api.sampler_stop_ids(tokenizer_lib.ByteTokenizer(), env) == (ord("]"),)
  # Only multi-turn components make the mixture multi-turn.
  single = registry.ENVS["mixture"].make_env_fn(
      _mixture_cfg(arith=dict(weight=1.0), math_answer=dict(weight=1.0)),
      tokenizer_lib.ByteTokenizer())
  assert not single.multi_turn


def test_the_stream_follows_the_weights():
  cfg = _mixture_cfg()
  prompts = registry.ENVS["mixture"].make_prompts_fn(cfg, "train")
  by_env = {n: [p for p in prompts if p.env == n] for n in cfg.weights}
  it = prompt_data.mixed_iterator(by_env, cfg.weights, seed=0, shard_index=0, shard_count=1)
  drawn = [next(it).env for _ in range(400)]
  assert drawn.count("arith") == 300  # weights 3 : 1
  state = it.get_state()
  expected = [next(it).prompt_id for _ in range(10)]
  again = prompt_data.mixed_iterator(by_env, cfg.weights, seed=0, shard_index=0, shard_count=1)
  again.set_state(state)
  assert [next(again).prompt_id for _ in range(10)] == expected


@pytest.mark.parametrize("components, message", [
    ({}, "env.components is empty"),
    ({"chess": {"weight": 1.0}}, "env.components.chess: unknown environment 'chess'"),
    ({"arith": {"max_operand": 9}}, r"env.components.arith.weight must be a number > 0"),
    ({"arith": {"weight": 1.0, "maxop": 9}}, r"env.components.arith: unknown key\(s\) \['maxop'\]"),
    ({"mixture": {"weight": 1.0}}, "unknown environment 'mixture'"),
])
def test_bad_mixture_config_names_the_component(components, message):
  with pytest.raises(ValueError, match=message):
    mixture.MixtureConfig(components=components)


def test_jsonl_records_must_name_a_component(tmp_path):
  cfg = _mixture_cfg()
  path = tmp_path / "mixed.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in [
      {"prompt": "1+2=", "answer": "3", "env": "arith", "id": 12},
      {"prompt": "k3?", "answer": "301", "env": "tool_agent", "id": 3},
      {"prompt": "x", "answer": "1"},
  ]) + "\n")
  data = prompt_source.DataConfig(train_path=str(path), on_malformed="skip")
  loaded = prompt_source.load("mixture", cfg, data, "train")
  assert [(p.env, p.prompt_id) for p in loaded.prompts] == [("arith", 12), ("tool_agent", 3)]
  assert "mixed.jsonl:3: field 'env' must name one of the mixture's environments" in (
      loaded.skipped[0])


def test_a_mixed_run_reports_reward_and_drops_per_environment(tmp_path):
  config = tiny.load_config("tool_agent", "tiny")
  fields = {k: v for k, v in config.env.items() if k not in ("name", "num_workers", "timeout_s")}
  config.env = dict(name="mixture", num_workers=config.env.num_workers, timeout_s=5.0,
                    components=dict(tool_agent=dict(weight=1.0, **fields),
                                    arith=dict(weight=1.0, max_operand=9)))
  config.num_steps = 4
  config.eval_every = 4
  config.orchestrator.max_off_policy_steps = 0  # drop something, to see it per environment
  spec = run_spec.build(config)
  assert spec.engine.multi_turn
  result = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None)
  assert result.final_version == 4
  records = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  rl = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  seen = set()
  for r in rl:
    seen |= set(r["reward_by_env"])
    assert set(r["drops_by_env"]) <= {"arith", "tool_agent"}
  assert seen == {"arith", "tool_agent"}
  evals = [r for r in records if "eval_reward_by_env" in r]
  assert evals and set(evals[-1]["eval_reward_by_env"]) == {"arith", "tool_agent"}
  assert np.isfinite(rl[-1]["loss"])
