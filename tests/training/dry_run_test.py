"""`--dry_run`: the plan's exact parts equal what a run allocates, and the CLI validates."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from arl_jax.config import run_spec
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.learner import publish as publish_lib
from arl_jax.models import init_lib, lora
from arl_jax.sampler import precompile, slot_fns
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import tiny
from arl_jax.training import dry_run, evaluation, process_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _device_bytes(tree) -> int:
  """Bytes one device holds of every array in `tree` (its first addressable shard)."""
  return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def test_planned_params_and_kv_cache_equal_the_allocated_ones():
  config = tiny.load_config("tool_agent", "tiny")
  spec = run_spec.build(config)
  plan = dry_run.plan(spec, jax.device_count())
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  assert plan.learner.mesh == tuple(meshes.learner.shape.items())
  assert plan.sampler.mesh == tuple(meshes.sampler.shape.items())
  assert not plan.colocated and plan.num_params == spec.model.num_params
  _, params, _ = init_lib.init_params(spec.model, meshes.learner, rules_lib.LEARNER_RULES, 0)
  assert plan.learner.memory["params"] == _device_bytes(params)
  assert plan.learner.memory["adam_moments"] == 2 * _device_bytes(params)
  graphdef, abstract = init_lib.abstract_model(spec.model)
  shardings = rules_lib.state_shardings(abstract, meshes.sampler, rules_lib.SAMPLER_RULES)
  sampler_params = jax.device_put(params, shardings)
  assert plan.sampler.memory["params_x2_versions"] == 2 * _device_bytes(sampler_params)
  fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=spec.sampler_model,
                                    mesh=meshes.sampler, settings=spec.sampling,
                                    num_slots=spec.engine.num_slots, length=spec.engine.length)
  slots = fns.init()
  cache = (*slots.cache.keys, *slots.cache.values)
  assert plan.sampler.memory["kv_cache"] == _device_bytes(cache)
  assert plan.per_device_peak() == max(plan.learner.peak, plan.sampler.peak)

  # The evaluation: the greedy pass's cache on the learner mesh (a slot a
  # prompt); the sampled pass's params copy and cache on the sampler mesh.
  config.eval_samples = 4
  spec = run_spec.build(config)
  plan = dry_run.plan(spec, jax.device_count())

  def eval_cache(model_cfg, mesh, engine):  # (what evaluation.Evaluator's generators hold)
    slots = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=model_cfg, mesh=mesh,
                                      settings=spec.sampling, num_slots=engine.num_slots,
                                      length=engine.length).init()
    return _device_bytes((*slots.cache.keys, *slots.cache.values))

  greedy = evaluation.greedy_engine_config(spec.engine, spec.run.eval_size)
  sampled = evaluation.sampled_engine_config(spec.engine, spec.run.eval_size, 4)
  assert (greedy.num_slots, sampled.num_slots) == (spec.run.eval_size, spec.engine.num_slots)
  assert plan.learner.memory["eval_kv_cache"] == eval_cache(spec.model, meshes.learner, greedy)
  assert plan.sampler.memory["eval_sampled_kv_cache"] == eval_cache(spec.sampler_model,
                                                                    meshes.sampler, sampled)
  assert plan.sampler.memory["eval_sampled_params"] == _device_bytes(sampler_params)


def test_planning_for_more_devices_shards_further():
  spec = run_spec.build(tiny.load_config("arith", None))
  small, big = dry_run.plan(spec, 2), dry_run.plan(spec, 16)
  assert dict(big.learner.mesh) == {"fsdp": 8, "tp": 1}
  assert big.learner.memory["params"] < small.learner.memory["params"]
  assert big.sampler.memory["kv_cache"] * 8 == small.sampler.memory["kv_cache"]
  text = dry_run.format_plan(big, device_memory=16 * 1024**3)
  assert "learner mesh {'fsdp': 8, 'tp': 1}" in text and "fits in 16.0 GiB" in text
  one = dry_run.plan(spec, 1)
  assert one.colocated and one.per_device_peak() == one.learner.peak + one.sampler.peak
  # The update's and an evaluation's own memory never coexist: the larger counts.
  update = sum(one.learner.memory.get(name, 0) for name in dry_run.UPDATE)
  evaluating = sum(one.learner.memory.get(name, 0) for name in dry_run.EVALUATION)
  assert update and evaluating
  assert one.learner.peak == one.learner.total - min(update, evaluating)
  assert np.isclose(one.learner.memory["params"], spec.model.num_params * 4)
  # Microbatches: the scan's gradient sum is one more copy of the gradients.
  assert "gradient_accumulator" not in one.learner.memory
  config = tiny.load_config("arith", None)
  config.learner.num_microbatches = 2
  two = dry_run.plan(run_spec.build(config), 1)
  assert two.learner.memory["gradient_accumulator"] == two.learner.memory["gradients"]


def test_an_evaluation_insert_is_planned_at_its_widest_and_the_cpu_process_on_top():
  """The greedy pass inserts at most `max_insert_rows` (32) prompts at once:
  their fresh keys and values and a copy; on a CPU backend the process
  (runtime and compiled programs: `process_plan`) adds to the busiest device."""
  config = tiny.load_config("arith", None)
  config.update(eval_size=100, eval_every=1)
  spec = run_spec.build(config)
  greedy = evaluation.greedy_engine_config(spec.engine, spec.run.eval_size)
  assert greedy.insert_rows == 32 and greedy.num_slots == 100
  plan = dry_run.plan(spec, 1)
  per_column = plan.learner.memory["eval_kv_cache"] // (100 * greedy.length)
  assert plan.learner.memory["eval_insert_rough"] == (
      2 * 32 * max(greedy.prompt_buckets) * per_column)
  on_cpu = dry_run.plan(spec, 1, cpu=True)
  assert plan.process == 0 and on_cpu.process == process_plan.cpu_process_bytes(spec)
  # (a compilation's working memory: its own phase, larger than this update's)
  compiling = on_cpu.learner.memory["compile_rough"]
  assert compiling == process_plan.compile_transient_bytes(spec) and "compile_rough" not in (
      plan.learner.memory)
  assert on_cpu.learner.peak == on_cpu.learner.total - sum(
      on_cpu.learner.memory[name] for name in (*dry_run.UPDATE, *dry_run.EVALUATION)
      if name in on_cpu.learner.memory)
  assert on_cpu.per_device_peak() == (on_cpu.learner.peak + on_cpu.sampler.peak
                                      + on_cpu.process)
  # Every program an engine may compile, and an update per packed width.
  decoder, mover = process_plan.engine_programs(spec.engine)
  assert decoder + mover == precompile.engine_shapes(spec.engine).num_programs
  assert on_cpu.process > process_plan.RUNTIME + (decoder + mover) * process_plan.MOVER_PROGRAM
  assert "process (a CPU backend" in dry_run.format_plan(on_cpu)
  assert "process (a CPU backend" not in dry_run.format_plan(plan)


def test_the_cli_dry_run_prints_the_plan_and_rejects_bad_config():
  cmd = [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py", "--dry_run",
         "--dry_run_devices=8"]
  env = dict(os.environ, XLA_FLAGS="")
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "resolved config:" in proc.stdout and "max_off_policy_steps: 8" in proc.stdout
  assert "learner mesh {'fsdp': 4, 'tp': 1}" in proc.stdout and "kv_cache" in proc.stdout
  bad = subprocess.run([*cmd, "--config.sampler.top_p=2.0"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "config.sampler.top_p" in bad.stderr


# Qwen2.5-0.5B-Instruct's config.json (the keys the import reads).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "use_sliding_window": False, "vocab_size": 151936, "torch_dtype": "bfloat16",
}


def test_the_tpu_config_plans_inside_a_v5e_chip(tmp_path):
  """configs/math_tpu.py validates and fits 16 GiB chips (a stand-in folder:
  Qwen2.5-0.5B's config.json and a tokenizer of its vocabulary size; the plan
  needs no weights)."""
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {f"t{i}": i for i in range(151_643)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
  tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
                         + [f"<|extra_{i}|>" for i in range(19)])
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
      # Qwen2.5's template without its tool branches: ChatML, a default system turn.
      "chat_template": (
          "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
          "assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")}))
  spec = run_spec.build(tiny.load_config("math_tpu", str(tmp_path)))
  assert spec.model.vocab_size == 151_936 and spec.model.qkv_bias
  assert spec.model.num_params == 494_032_768  # the published parameter count
  tokenizer = tokenizer_lib.make_tokenizer(spec.tokenizer)
  assert tokenizer.template.end_of_turn == "<|im_end|>" and tokenizer.bos_id is None
  plan = dry_run.plan(spec, 8)
  assert dict(plan.learner.mesh) == {"fsdp": 4, "tp": 1}
  assert plan.per_device_peak() < 0.9 * 16 * 1024**3


def test_coordinator_flags_initialise_jax_distributed():
  """One process on loopback: `--coordinator_address` brings up jax.distributed."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  cmd = [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py:tiny", "--dry_run",
         f"--coordinator_address=127.0.0.1:{port}", "--num_processes=1", "--process_id=0"]
  proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, XLA_FLAGS=""), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "process 0 of 1 (jax.distributed initialized)" in proc.stdout


def test_kv_memory_fraction_sizes_a_paged_pool_that_the_plan_and_the_run_agree_on():
  config = tiny.load_config("arith", None)
  config.sampler.kv_cache, config.sampler.kv_memory_fraction = "paged", 0.25
  with pytest.raises(run_spec.ConfigError, match="sampler.kv_memory_fraction.*--dry_run_device"):
    run_spec.build(config)  # CPU devices report no memory
  memory = 3 * 2**20
  spec = run_spec.build(config, device_memory=memory)
  page_bytes = 16 * spec.sampler_model.num_layers * 2 * spec.sampler_model.num_kv_heads * (
      spec.sampler_model.head_dim * 4)
  assert spec.engine.kv_pages == int(0.25 * memory) // page_bytes > spec.engine.pages_per_slot
  plan = dry_run.plan(spec, jax.device_count())
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  graphdef, _ = init_lib.abstract_model(spec.model)
  fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=spec.sampler_model,
                                  mesh=meshes.sampler, settings=spec.sampling,
                                  num_slots=spec.engine.num_slots, length=spec.engine.length,
                                  num_pages=spec.engine.pool_pages, page_size=16)
  pool = fns.init().cache
  name = f"kv_cache_paged_{spec.engine.kv_pages}x16"
  assert plan.sampler.memory[name] == _device_bytes((*pool.keys, *pool.values))
  assert 0.25 * memory - page_bytes < plan.sampler.memory[name] <= 0.25 * memory
  with pytest.raises(run_spec.ConfigError, match=r"makes 1 pages .* needs >= 3"):
    run_spec.build(config, device_memory=page_bytes)
  config.sampler.kv_pages = 64
  with pytest.raises(run_spec.ConfigError, match="set one of them"):
    run_spec.build(config, device_memory=memory)


def test_the_cli_plans_a_pool_for_the_device_memory_it_is_given():
  cmd = [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py", "--dry_run",
         "--dry_run_devices=8", "--config.sampler.kv_cache=paged",
         "--config.sampler.kv_memory_fraction=0.5"]
  env = dict(os.environ, XLA_FLAGS="")
  proc = subprocess.run([*cmd, "--dry_run_device_gib=0.001"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  spec = run_spec.build(tiny.load_config("arith", None))
  page_bytes = 16 * spec.model.num_layers * 2 * spec.model.num_kv_heads * spec.model.head_dim * 4
  assert f"kv_cache_paged_{int(0.5 * 2**30 * 0.001) // page_bytes}x16" in proc.stdout
  bad = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert bad.returncode == 2 and "kv_memory_fraction" in bad.stderr
  assert "Traceback" not in bad.stderr


def test_a_lora_plan_holds_the_base_once_and_equals_what_a_run_allocates():
  config = tiny.load_config("tool_agent", "tiny")
  config.learner.lora.rank = 4
  spec = run_spec.build(config)
  plan = dry_run.plan(spec, jax.device_count())
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  _, params, shardings = init_lib.init_params(spec.model, meshes.learner,
                                              rules_lib.LEARNER_RULES, 0)
  adapters, base = lora.split(params)
  assert plan.learner.memory["adapters"] == _device_bytes(adapters)
  assert plan.learner.memory["adam_moments"] == 2 * _device_bytes(adapters)
  assert plan.learner.memory["frozen_base"] == _device_bytes(base)
  assert "params" not in plan.learner.memory
  _, abstract = init_lib.abstract_model(spec.model)
  sampler_shardings = rules_lib.state_shardings(abstract, meshes.sampler, rules_lib.SAMPLER_RULES)
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings, frozen=base)
  publisher.publish(adapters, 0)
  on_sampler, base_on_sampler = lora.split(publisher.latest()[1])
  assert plan.sampler.memory["base"] == _device_bytes(base_on_sampler)
  assert plan.sampler.memory["adapters_x2_versions"] == 2 * _device_bytes(on_sampler)
  assert plan.publish_bytes == publisher.published_bytes
  assert plan.trainable_params == spec.model.adapter_params
  text = dry_run.format_plan(plan)
  assert f"trained with LoRA: {spec.model.adapter_params:,} parameters" in text
  full = dry_run.plan(run_spec.build(tiny.load_config("tool_agent", "tiny")),
                      jax.device_count())
  assert plan.publish_bytes == 4 * spec.model.adapter_params
  assert full.publish_bytes == 4 * spec.model.num_params > plan.publish_bytes
  # Both roles on one device in one dtype: the sampler reads the learner's base.
  one = dry_run.plan(spec, 1)
  assert one.colocated and one.sampler.memory["base_from_learner"] == 0
  assert "base" not in one.sampler.memory
  assert one.learner.memory["frozen_base"] == plan.sampler.memory["base"]
  config.sampler.param_dtype = "bfloat16"  # (a cast is a copy of its own)
  assert dry_run.plan(run_spec.build(config), 1).sampler.memory["base"] > 0
