"""Bad configuration is rejected, naming the problem, before anything compiles."""

import json
import os
import subprocess
import sys

import jax
import pytest

from arl_jax.config import run_spec
from arl_jax.envs import prompt_source
from arl_jax.testing import tiny
from arl_jax.training import run_lib


def _config(**overrides):
  config = tiny.load_config("arith", "tiny")
  for dotted, value in overrides.items():
    section, key = dotted.split("__") if "__" in dotted else (None, dotted)
    (config[section] if section else config)[key] = value
  return config


def test_tiny_and_default_configs_build():
  for arg in ("tiny", None, "sync"):
    spec = run_spec.build(tiny.load_config("arith", arg))
    assert spec.orchestrator.groups_per_batch * spec.orchestrator.group_size > 0
  sync = run_spec.build(tiny.load_config("arith", "sync"))
  assert (sync.orchestrator.max_async_level,
          sync.orchestrator.max_off_policy_steps,
          sync.engine.weight_update) == (0, 0, "drain")


@pytest.mark.parametrize("overrides, message", [
    ({"orchestrator__max_off_policy_steps": -1}, r"orchestrator.max_off_policy_steps: K must be >= 0"),
    ({"orchestrator__max_async_level": -2}, r"orchestrator.max_async_level"),
    ({"orchestrator__batch_size": 30}, r"orchestrator.batch_size: 30 rollouts is not a positive int multiple of orchestrator.group_size=4"),
    ({"orchestrator__assembly": "lifo"}, r"orchestrator.assembly: must be one of"),
    ({"sampler__prompt_len": 4}, r"sampler.prompt_len: a prompt of env 'arith' has 5 tokens"),
    ({"sampler__max_new_tokens": 40}, r"exceeds the model context model.max_seq_len=32"),
    ({"sampler__max_new_tokens": 2}, r"sampler.max_new_tokens: the longest correct answer of env 'arith' needs 3 tokens"),
    ({"sampler__num_slots": 30}, r"sampler.num_slots: 30 must be a positive multiple"),
    ({"sampler__weight_update": "sometimes"}, r"sampler.weight_update"),
    ({"sampler__kv_policy": "forget"}, r"sampler.kv_policy: must be one of \('keep', 'recompute'\)"),
    ({"sampler__top_p": 0.0}, r"sampler.top_p: must be in \(0, 1\]"),
    ({"sampler__top_k": -1}, r"sampler.top_k: must be an int >= 0"),
    ({"sampler__min_p": 1.5}, r"sampler.min_p: must be in \[0, 1\) \(0: off\), got 1.5"),
    ({"sampler__prompt_buckets": (4, 99)}, r"sampler.prompt_buckets: \(4, 99\): every bucket must be in \[1, prompt_len=6\]"),
    ({"learner__loss": "ppo2"}, r"learner.loss: unknown loss 'ppo2'"),
    ({"learner__aggregation": "sum"}, r"learner.aggregation: must be one of"),
    ({"learner__tis_cap": 0.5}, r"learner.tis_cap: must be 0 \(off\) or >= 1"),
    ({"learner__mismatch_mask": "row"}, r"config.learner.mismatch_mask: must be one of"),
    ({"learner__loss": "vtrace", "learner__seq_tis_cap": 2.0}, r"config.learner: vtrace truncates .* a mismatch correction"),
    ({"learner__cispo_eps_low": 1.5}, r"config.learner.cispo_eps_low: the weight's bounds"),
    ({"learner__lr_schedule": "step"}, r"config.learner.lr_schedule: must be one of"),
    ({"learner__advantage": "ppo"}, r"config.learner.advantage: must be one of"),
    ({"warmup__lr_schedule": "step"}, r"config.warmup.lr_schedule: must be one of"),
    ({"orchestrator__overlong_buffer": 64}, r"config.orchestrator.overlong_buffer: 64 tokens: not below sampler.max_new_tokens"),
    ({"eval_temperature": 0.0}, r"eval_temperature: must be > 0"),
    ({"eval_samples": -1}, r"eval_samples: must be an int >= 0"),
    ({"eval_slots": -1}, r"eval_slots: must be an int >= 0"),
    ({"learner__num_minibatches": 3}, r"learner.num_microbatches: orchestrator.batch_size=32 rows do not split into num_minibatches x num_microbatches = 3"),
    ({"learner__num_epochs": 0}, r"learner.num_epochs: must be an int >= 1"),
    ({"learner__loss": "vtrace", "learner__num_epochs": 2}, r"config.learner: vtrace truncates its importance weights itself"),
    ({"learner__loss": "m2po", "learner__age_decay": 0.5}, r"config.learner: m2po has no clip range"),
    ({"model__value_head": True}, r"model.value_head: a critic is trained only by learner.loss='vtrace'"),
    ({"learner__c_bar": 2.0}, r"learner.c_bar: must be in \(0, rho_bar=1.0\]"),
    ({"learner__lam": 1.5}, r"learner.lam: must be in \[0, 1\]"),
    ({"data__on_malformed": "ignore"}, r"config.data: data.on_malformed must be one of \('error', 'skip'\)"),
    ({"data__train_path": "/nonexistent.jsonl"}, r"config.data.train_path: .*No such file"),
    ({"orchestrator__requeue_dropped": -1}, r"orchestrator.requeue_dropped: must be an int >= 0"),
    ({"model__num_kv_heads": 3}, r"config.model: model.num_heads=2 must be a multiple"),
    ({"env__name": "chess"}, r"env.name: unknown environment 'chess'"),
    ({"mesh__learner": (("fsdp", 16), ("tp", 1))}, r"mesh.learner=.*needs 16 devices but the role has 4"),
    ({"mesh__placement": "everywhere"}, r"mesh.placement must be one of"),
    ({"mesh__learner_devices": 8}, r"mesh.learner_devices=8 must leave at least one device"),
])
def test_bad_config_is_rejected_with_a_message_naming_it(overrides, message):
  with pytest.raises(run_spec.ConfigError, match=message):
    run_spec.build(_config(**overrides))


def test_tool_agent_configs_build_a_multi_turn_sampler():
  for arg in ("tiny", None, "sync"):
    spec = run_spec.build(tiny.load_config("tool_agent", arg))
    assert spec.env_name == "tool_agent" and spec.engine.multi_turn
    assert spec.sampling.stop_ids == (ord("]"),)
    # Spare columns so that re-admitted contexts round up without eating the budget.
    assert spec.engine.length == (spec.engine.prompt_len + spec.engine.max_new_tokens
                                  + spec.engine.context_step)
  assert not run_spec.build(_config()).engine.multi_turn


def test_the_staleness_section_builds_into_the_orchestrator_and_its_errors_name_the_key():
  config = _config(orchestrator__max_off_policy_steps=4)
  config.orchestrator.staleness.update(policy="adaptive", k_min=1, k_max=6, ess_target=0.8)
  staleness = run_spec.build(config).orchestrator.staleness
  assert (staleness.policy, staleness.k_max, staleness.ess_target) == ("adaptive", 6, 0.8)
  config.orchestrator.max_off_policy_steps = 8
  with pytest.raises(run_spec.ConfigError, match=r"config.orchestrator.max_off_policy_steps: 8: "
                     r"under staleness.policy='adaptive' K starts here, which must lie in "
                     r"\[staleness.k_min, staleness.k_max\] = \[1, 6\]"):
    run_spec.build(config)
  config.orchestrator.staleness.k_max = 0
  with pytest.raises(run_spec.ConfigError,
                     match=r"config.orchestrator.staleness.k_max: must be an int >= k_min=1"):
    run_spec.build(config)
  config.orchestrator.staleness.update(k_max=8, policy="dynamic")
  with pytest.raises(run_spec.ConfigError, match=r"config.orchestrator.staleness.policy: must be "
                     r"one of \('fixed', 'adaptive'\), got 'dynamic'"):
    run_spec.build(config)
  config.orchestrator.staleness.kmax = 3
  with pytest.raises(run_spec.ConfigError,
                     match=r"config.orchestrator.staleness: unknown key\(s\) \['kmax'\]"):
    run_spec.build(config)


def test_env_keys_are_those_of_the_chosen_environment():
  config = _config()
  config.env.latency_median_s = 0.1  # a tool_agent key on an arith run
  with pytest.raises(run_spec.ConfigError,
                     match=r"config.env: unknown key\(s\) \['latency_median_s'\]"):
    run_spec.build(config)
  with pytest.raises(run_spec.ConfigError, match=r"env.timeout_s: must be >= 0"):
    run_spec.build(_config(env__timeout_s=-1.0))
  config = tiny.load_config("tool_agent", "tiny")
  config.env.latency_p99_s = 0.01
  with pytest.raises(run_spec.ConfigError, match=r"config.env: env.latency_p99_s"):
    run_spec.build(config)


def test_prompt_buckets_always_include_prompt_len():
  spec = run_spec.build(_config(sampler__prompt_buckets=(4, 2)))
  assert spec.engine.prompt_buckets == (2, 4, 6)
  # Plus spare columns for contexts re-admitted past the longest prompt (a
  # checkpoint's open segments), no more than the budget.
  assert spec.engine.length == 6 + 2 * spec.engine.max_new_tokens  # budget < context_bucket


def test_unknown_key_is_rejected():
  config = _config()
  config.learner.lrr = 1e-3
  with pytest.raises(run_spec.ConfigError, match=r"config.learner: unknown key\(s\) \['lrr'\]"):
    run_spec.build(config)
  config = _config()
  config.stepz = 3
  with pytest.raises(run_spec.ConfigError, match=r"unknown key\(s\) \['stepz'\]"):
    run_spec.build(config)


def test_mesh_needing_more_devices_than_exist():
  config = _config(mesh__placement="colocated", mesh__learner=(("fsdp", 16), ("tp", 1)))
  with pytest.raises(run_spec.ConfigError, match="needs 16 devices but the role has 8"):
    run_spec.build(config)


def test_run_rejects_bad_config_before_writing_or_compiling(tmp_path):
  with pytest.raises(run_spec.ConfigError, match="orchestrator.batch_size"):
    run_lib.run(_config(orchestrator__batch_size=6), str(tmp_path))
  assert not os.listdir(tmp_path)


def test_launch_rejects_unknown_override_on_the_command_line(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run(
      [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py:tiny",
       f"--workdir={tmp_path}", "--config.learner.lrr=1"],
      cwd=repo, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "lrr" in proc.stderr
  assert not os.listdir(tmp_path)


def test_a_malformed_prompt_file_fails_the_config_naming_file_and_line(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
  config = _config()
  config.data.train_path = str(path)
  with pytest.raises(run_spec.ConfigError,
                     match=r"config.data.train_path: .*train.jsonl:2: field 'answer'"):
    run_spec.build(config)
  config.data.on_malformed = "skip"
  assert run_spec.build(config).data.on_malformed == "skip"


def test_a_file_prompt_too_long_names_file_and_line_and_can_be_skipped(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n'
                  '{"prompt": "1234567890+1=", "answer": "2"}\n')
  config = _config()  # sampler.prompt_len=6
  config.data.train_path = str(path)
  with pytest.raises(run_spec.ConfigError,
                     match=r"config.data.train_path: .*train.jsonl:2: prompt has 14 tokens, "
                           r"more than sampler.prompt_len=6"):
    run_spec.build(config)
  config.data.on_malformed = "skip"
  spec = run_spec.build(config)
  # What the run loads (run_lib: prompt_source.load of spec.data) leaves the
  # line out and reports it with the other skipped lines.
  train = prompt_source.load(spec.env_name, spec.env, spec.data, "train")
  assert [p.text for p in train.prompts] == ["1+1="]
  assert train.skipped == [f"{path}:2: prompt has 14 tokens, more than sampler.prompt_len=6"]


def test_a_run_reports_the_too_long_lines_it_skipped(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n'
                  '{"prompt": "1234567890+1=", "answer": "2"}\n')
  config = _config(num_steps=0, eval_every=0, warmup__steps=0)
  config.data.update(train_path=str(path), on_malformed="skip")
  lines = []
  run_lib.run(config, str(tmp_path / "run"), print_fn=lines.append)
  assert any(line.startswith("warning: skipped 1 malformed train line(s), first: ")
             and "train.jsonl:2: prompt has 14 tokens" in line for line in lines), lines
  with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  data = [r for r in records if r.get("phase") == "data"]
  assert data == [{"phase": "data", "split": "train", "skipped_lines": 1, "skipped": [
      f"{path}:2: prompt has 14 tokens, more than sampler.prompt_len=6"]}]


def test_an_arith_answer_that_is_not_a_number_names_file_line_and_field(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2=", "answer": "abcdefgh"}\n')
  config = _config()
  config.data.train_path = str(path)
  with pytest.raises(run_spec.ConfigError,
                     match=r"config.data.train_path: .*train.jsonl:2: field 'answer' must be an "
                           r"integer for env 'arith', got 'abcdefgh'"):
    run_spec.build(config)
  config.data.on_malformed = "skip"
  assert run_spec.build(config).env_name == "arith"


def test_explicit_learner_devices_need_the_devices_to_split():
  config = _config(mesh__learner_devices=4)
  with pytest.raises(run_spec.ConfigError,
                     match=r"config.mesh.learner_devices=4 asks for 4 learner device\(s\) per "
                           r"process .* only 1 device\(s\) are present"):
    run_spec.build(config, devices=jax.devices()[:1])
  # Planning for more devices than are here (--dry_run_devices) counts those.
  assert run_spec.build(config, devices=list(range(8))).mesh.learner_devices == 4
  # The automatic split still falls back to colocated on one device.
  run_spec.build(_config(), devices=jax.devices()[:1])


def test_math_answer_configs_build():
  for arg in (None, "sync", "tiny"):
    spec = run_spec.build(tiny.load_config("math_answer", arg))
    assert spec.env_name == "math_answer" and not spec.engine.multi_turn
