"""Learner checkpoints: exact round trip, onto another mesh, safe under donation, resumable."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from arl_jax import checkpointing, config_lib, run_lib
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.models import init_lib
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import tiny


def _state(learner_devices: int, seed: int):
  cfg = tiny.tiny_model_config()
  meshes = mesh_lib.make_role_meshes(
      mesh_lib.MeshConfig(placement="disaggregated", learner_devices=learner_devices),
      jax.devices()[:2 * learner_devices])
  _, params, _ = init_lib.init_params(cfg, meshes.learner, rules_lib.LEARNER_RULES, seed)
  optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig(lr=1e-3))
  return train_state_lib.create(params, optimizer, meshes.learner)


def test_a_checkpoint_restores_exactly_onto_a_smaller_mesh_despite_donation(tmp_path):
  state, _ = _state(learner_devices=4, seed=0)
  saved = jax.device_get(state)
  ckpt = checkpointing.Checkpointer(str(tmp_path), checkpointing.CheckpointConfig(every_steps=1))
  ckpt.save(3, state, {"version": 3, "prompts_drawn": 12})
  # The next update donates the state's buffers while the save may still be
  # writing: the checkpoint must hold the values as they were at save().
  scramble = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
  jax.block_until_ready(scramble(state))
  ckpt.wait()
  target, target_shardings = _state(learner_devices=2, seed=1)
  restored, record = ckpt.restore(checkpointing.abstract_like(target, target_shardings))
  assert record == {"format_version": checkpointing.FORMAT_VERSION, "version": 3,
                    "prompts_drawn": 12, "has_reference": False}
  embed = restored.params["embed"][...]
  assert embed.sharding.mesh.shape["fsdp"] == 2  # laid out as the new run asks
  for want, got in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(want, np.asarray(got))
  ckpt.close()


def test_an_incompatible_checkpoint_is_named(tmp_path, monkeypatch):
  state, shardings = _state(learner_devices=4, seed=0)
  monkeypatch.setattr(checkpointing, "FORMAT_VERSION", 0)
  ckpt = checkpointing.Checkpointer(str(tmp_path), checkpointing.CheckpointConfig(keep=1))
  ckpt.save(1, state, {"version": 1})
  ckpt.wait()
  monkeypatch.setattr(checkpointing, "FORMAT_VERSION", 1)
  with pytest.raises(checkpointing.CheckpointFormatError, match="checkpoint format 0, this code reads format 1"):
    ckpt.restore(checkpointing.abstract_like(state, shardings))
  ckpt.close()


def test_a_run_resumes_from_its_workdir_and_continues_the_versions(tmp_path):
  config = tiny.load_config("arith", "tiny")
  config.num_steps = 4
  config.eval_every = 0
  config.checkpoint = {"every_steps": 2, "keep": 2}
  first = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None, keep_batches=True)
  assert first.final_version == 4
  assert checkpointing.Checkpointer(str(tmp_path / "checkpoints"),
                                    checkpointing.CheckpointConfig()).latest_step() == 4
  config.num_steps = 6
  lines = []
  second = run_lib.run(config, str(tmp_path), print_fn=lines.append, keep_batches=True)
  assert any("resumed from" in line and "version 4" in line for line in lines)
  assert second.final_version == 6
  assert [r["step"] for r in second.history] == [4, 5]
  assert [b["batch_version"] for b in second.trained_batches] == [4, 5]
  # Groups of the resumed run were dispatched at versions >= 4.
  assert min(min(b["dispatch_versions"]) for b in second.trained_batches) >= 4


def test_bad_checkpoint_settings_name_the_key():
  config = tiny.load_config("arith", "tiny")
  config.checkpoint = {"every_steps": -1}
  with pytest.raises(config_lib.ConfigError, match="checkpoint.every_steps"):
    config_lib.build(config)
  config.checkpoint = {"evry_steps": 1}
  with pytest.raises(config_lib.ConfigError, match=r"config.checkpoint: unknown key\(s\)"):
    config_lib.build(config)


def _final_state(workdir):
  """`(step, leaves)` of a workdir's latest checkpoint, restored as saved."""
  manager = ocp.CheckpointManager(str(workdir / "checkpoints"), item_names=("state", "run"))
  step = manager.latest_step()
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  return step, jax.tree.leaves(restored["state"])


def test_a_resumed_synchronous_run_ends_with_the_same_parameters(tmp_path):
  """Deterministic settings (synchronous, drain): stopping after 3 updates and
  resuming gives bit-for-bit the parameters of an uninterrupted run, because
  the groups unfinished at the save are dispatched again with their group ids."""
  base = tiny.load_config("arith", "tiny")
  base.orchestrator.update(max_async_level=0, max_off_policy_steps=0)
  base.sampler.weight_update = "drain"
  base.eval_every = 0
  base.num_steps = 6
  base.checkpoint = {"save_final": True}
  run_lib.run(base, str(tmp_path / "whole"), print_fn=lambda *_: None)
  base.num_steps = 3
  base.checkpoint = {"every_steps": 3, "save_final": True}
  run_lib.run(base, str(tmp_path / "split"), print_fn=lambda *_: None)
  base.num_steps = 6
  lines = []
  run_lib.run(base, str(tmp_path / "split"), print_fn=lines.append)
  assert any("resumed from" in line and "version 3" in line for line in lines)
  step_a, whole = _final_state(tmp_path / "whole")
  step_b, split = _final_state(tmp_path / "split")
  assert step_a == step_b == 6
  for a, b in zip(whole, split):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_async_resume_loses_no_prompt_and_repeats_none(tmp_path):
  """Groups in flight or buffered at the save are dispatched again after the
  resume: every prompt drawn before the save is trained once (or dropped by
  the staleness rule), none twice."""
  config = tiny.load_config("arith", "tiny")
  config.orchestrator.update(max_async_level=2, max_off_policy_steps=8)
  config.eval_every = 0
  config.num_steps = 3
  config.checkpoint = {"save_final": True}
  first = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None, keep_batches=True)
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), item_names=("state", "run"))
  record = manager.restore(3, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
  unfinished = [p["prompt_id"] for _, p, _ in record["pending"]["unfinished"]]
  assert unfinished, "the async run had nothing in flight at the save"
  config.num_steps = 7
  second = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None, keep_batches=True)
  trained_first = [p for b in first.trained_batches for p in b["prompt_ids"]]
  trained_second = [p for b in second.trained_batches for p in b["prompt_ids"]]
  trained = trained_first + trained_second
  assert len(trained) == len(set(trained))  # one epoch of 90 prompts: nothing repeats
  assert not set(unfinished) & set(trained_first)
  assert set(unfinished) <= set(trained_second)  # nothing in flight at the save was lost
  assert record["prompts_drawn"] == len(trained_first) + len(unfinished)
  # Drop and task accounting continues across the resume instead of restarting.
  with open(tmp_path / "metrics.jsonl") as f:
    last = [json.loads(line) for line in f if '"phase": "rl"' in line][-1]
  assert last["tasks_seen"] >= len(set(trained)) > len(set(trained_second))


def test_the_kl_reference_survives_a_resume(tmp_path):
  """The KL penalty keeps pulling toward the params the run started RL from,
  not toward the params it was resumed with."""
  config = tiny.load_config("arith", "tiny")
  config.learner.kl_coef = 0.1
  config.learner.entropy_coef = 0.01  # moves the params even when every reward is 0
  config.eval_every = 0
  config.num_steps = 2
  config.checkpoint = {"save_final": True}
  run_lib.run(config, str(tmp_path), print_fn=lambda *_: None)
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"),
                                  item_names=("state", "run", "reference"))
  saved = manager.restore(2, args=ocp.args.Composite(reference=ocp.args.StandardRestore(),
                                                     state=ocp.args.StandardRestore()))
  reference = jax.tree.leaves(saved["reference"])
  params = jax.tree.leaves(saved["state"]["params"])
  assert any(not np.array_equal(r, p) for r, p in zip(reference, params))  # RL moved them
  config.num_steps = 3
  run_lib.run(config, str(tmp_path), print_fn=lambda *_: None)
  again = manager.restore(3, args=ocp.args.Composite(reference=ocp.args.StandardRestore()))
  for a, b in zip(reference, jax.tree.leaves(again["reference"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
