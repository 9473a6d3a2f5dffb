"""LoRA runs: the `learner.lora` section, checkpoints that hold the adapters
only, a lossless resume, and a resume refused on another base."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from arl_jax.config import run_spec
from arl_jax.learner import checkpointing
from arl_jax.testing import tiny
from arl_jax.training import run_lib, start

RANK = 4


def _config(num_steps, **checkpoint):
  config = tiny.load_config("arith", "tiny")
  config.orchestrator.update(max_async_level=0, max_off_policy_steps=0)  # deterministic
  config.sampler.weight_update = "drain"
  config.eval_every = 0
  config.num_steps = num_steps
  config.checkpoint = {"save_final": True, **checkpoint}
  config.learner.lora.rank = RANK
  return config


def _saved_state(workdir):
  manager = ocp.CheckpointManager(str(workdir / "checkpoints"), item_names=("state", "run"))
  step = manager.latest_step()
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                           run=ocp.args.JsonRestore()))
  return step, restored["state"], restored["run"]


def test_the_lora_section_resolves_and_its_errors_name_the_key():
  config = tiny.load_config("arith", "tiny")
  assert run_spec.build(config).model.lora.rank == 0  # every config has it, off
  config.learner.lora.update(rank=8, alpha=16, targets=("q_proj", "v_proj"),
                             base_dtype="bfloat16")
  spec = run_spec.build(config)
  assert (spec.model.lora.rank, spec.model.lora.scale, spec.model.base_dtype) == (8, 2.0,
                                                                                   "bfloat16")
  # The sampler runs every parameter in its own dtype.
  assert spec.sampler_model.base_dtype == spec.sampler_model.param_dtype
  config.learner.lora.rnak = 2
  with pytest.raises(run_spec.ConfigError, match=r"config.learner.lora: unknown key\(s\) "
                     r"\['rnak'\]"):
    run_spec.build(config)
  del config.learner.lora.rnak
  config.learner.lora.targets = ("qkv",)
  with pytest.raises(run_spec.ConfigError,
                     match=r"config.learner.lora.targets: unknown module\(s\) \['qkv'\]"):
    run_spec.build(config)
  config.learner.lora.targets = ("all",)
  config.learner.lora.init_from = "/nonexistent/peft"
  with pytest.raises(run_spec.ConfigError, match="config.learner.lora.init_from: "):
    run_spec.build(config)


def test_a_resumed_lora_run_equals_an_uninterrupted_one_and_saves_adapters_only(tmp_path):
  run_lib.run(_config(4), str(tmp_path / "whole"), print_fn=lambda *_: None)
  run_lib.run(_config(2, every_steps=2), str(tmp_path / "split"), print_fn=lambda *_: None)
  lines = []
  run_lib.run(_config(4), str(tmp_path / "split"), print_fn=lines.append)
  assert any("resumed from" in line and "version 2" in line for line in lines)
  step_a, whole, record = _saved_state(tmp_path / "whole")
  step_b, split, _ = _saved_state(tmp_path / "split")
  assert step_a == step_b == 4
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The checkpoint: the adapters, Adam's two moments of them, and scalars; no base.
  spec = run_spec.build(_config(4))
  params = sum(np.size(x) for x in jax.tree.leaves(whole["params"]))
  assert params == spec.model.adapter_params
  assert sum(np.size(x) for x in jax.tree.leaves(whole)) < 3 * params + 16
  assert record["base"]["source"] == "random init (seed 0)"
  assert len(record["base"]["fingerprint"]) == 16


def test_a_lora_checkpoint_is_refused_on_another_base(tmp_path):
  run_lib.run(_config(1), str(tmp_path), print_fn=lambda *_: None)
  other = _config(2)
  other.seed = 1  # (a random base of another seed: another base)
  with pytest.raises(start.AnotherBase, match=r"LoRA adapters trained on another base: "
                     r"random init \(seed 0\) \(fingerprint [0-9a-f]{16}\); this run's base is "
                     r"random init \(seed 1\)"):
    run_lib.run(other, str(tmp_path), print_fn=lambda *_: None)
  full = _config(2)
  full.learner.lora.rank = 0
  with pytest.raises(start.AnotherBase, match="this run has no adapters"):
    run_lib.run(full, str(tmp_path), print_fn=lambda *_: None)
  # Nor are a LoRA run's checkpoints a model to start another run from.
  full.checkpoint = {"init_from": str(tmp_path / "checkpoints")}
  with pytest.raises(checkpointing.CheckpointFormatError,
                     match="its checkpoints hold LoRA adapters, not a model; merge them"):
    run_lib.run(full, str(tmp_path / "other"), print_fn=lambda *_: None)


def test_a_critic_trains_in_full_beside_the_adapters(tmp_path):
  """PEFT's `modules_to_save`: an actor-critic (vtrace) LoRA run trains the
  value head whole beside the adapters, starting from the head its base
  brings (here a full fine-tuning run's trained critic); the checkpoint
  holds both, and no base."""
  def critic(num_steps, rank):
    config = _config(num_steps)
    config.learner.update(loss="vtrace")
    config.model.value_head = True
    config.learner.lora.rank = rank
    config.warmup.update(steps=20, lr=0.01)  # (some answers right: a reward to learn)
    return config

  run_lib.run(critic(2, rank=0), str(tmp_path / "full"), print_fn=lambda *_: None)
  _, full, _ = _saved_state(tmp_path / "full")
  trained_head = np.asarray(jax.tree.leaves(full["params"]["value_head"])[0])
  assert np.abs(trained_head).max() > 0
  config = critic(2, rank=RANK)
  config.checkpoint.init_from = str(tmp_path / "full" / "checkpoints")
  config.warmup.steps = 0
  lines = []
  assert run_lib.run(config, str(tmp_path / "lora"), print_fn=lines.append).complete
  spec = run_spec.build(config)
  assert spec.model.trainable_params == spec.model.adapter_params + spec.model.d_model
  assert any(f"and the value head ({spec.model.trainable_params:,} trainable" in line
             for line in lines)
  _, state, _ = _saved_state(tmp_path / "lora")
  assert sum(np.size(x) for x in jax.tree.leaves(state["params"])) == spec.model.trainable_params
  head = np.asarray(jax.tree.leaves(state["params"]["value_head"])[0])
  assert not np.array_equal(head, trained_head)  # it trained on
  rows = [r for r in map(json.loads, open(tmp_path / "lora" / "metrics.jsonl"))
          if "value_loss" in r]
  assert [r["value_loss"] > 0 for r in rows] == [True, True]
  # Its first update saw the trained head's values (a fresh, zero head gives 0).
  assert rows[0]["value_mean"] != 0


@pytest.mark.parametrize("weight_update", ["pinned", "in_flight"])
def test_lora_runs_under_the_weight_update_modes(tmp_path, weight_update):
  """Adapters swap in flight (the KV recomputed) or are pinned per rollout:
  the run trains, and every rollout's behaviour log-probs are the learner's
  at lag 0 (the first batch: sampled by version 0, scored by it)."""
  config = _config(2)
  config.orchestrator.update(max_async_level=1, max_off_policy_steps=4)
  config.sampler.weight_update = weight_update
  if weight_update == "in_flight":
    config.sampler.kv_policy = "recompute"
  result = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None)
  assert result.complete and result.final_version == 2
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  first = next(r for r in rows if r.get("phase") == "rl" and "loss" in r)
  assert first["token_fraction_lag0"] > 0 and first["abs_log_ratio_lag0"] <= 1e-5

