"""Learner checkpoints: exact round trip, onto another mesh, safe under donation, resumable."""

import collections
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from arl_jax.config import run_spec
from arl_jax.learner import checkpointing
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.models import init_lib
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import slots as slots_lib
from arl_jax.testing import tiny
from arl_jax.training import run_lib


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


def test_a_save_in_flight_keeps_cpu_buffers_from_donation_until_released(tmp_path):
  """On CPU orbax's host copy is a view of the state's own buffers, kept
  until the write ends: an update donating them meanwhile cannot, and holds a
  second state beside the first. `release` waits for the write first."""
  state = {"w": jax.numpy.ones((32, 1024, 1024))}  # (128 MiB: a write that takes a while)
  step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
  ckpt = checkpointing.Checkpointer(str(tmp_path), checkpointing.CheckpointConfig(every_steps=1))
  ckpt.save(1, state, {"version": 1})
  next_state = jax.block_until_ready(step(state))
  if ckpt._manager.is_saving_in_progress():
    # Still writing after the step, so writing throughout it: the donation
    # was refused, the input lives on beside the output. (Whether the write
    # outlasts the step depends on the machine's load: not asserted when not.)
    assert not state["w"].is_deleted()
  ckpt.save(2, next_state, {"version": 2})
  ckpt.release(next_state)
  assert not ckpt._manager.is_saving_in_progress()
  jax.block_until_ready(step(next_state))
  assert next_state["w"].is_deleted()  # (donated: no second state)
  assert ckpt.release(next_state) == 0.0  # (nothing in flight: no wait)
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
  # Groups dispatched before the save are the ones it kept open (they keep
  # their dispatch versions); the resumed run dispatched everything else.
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), item_names=("state", "run"))
  record = manager.restore(4, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
  kept = {g["group_id"]: g["dispatch_version"] for g in record["work"]["groups"]}
  for batch in second.trained_batches:
    for gid, dispatched in zip(batch["group_ids"], batch["dispatch_versions"]):
      if dispatched < 4:
        assert kept.get(gid) == dispatched
      else:
        assert gid not in kept


def test_bad_checkpoint_settings_name_the_key():
  config = tiny.load_config("arith", "tiny")
  config.checkpoint = {"every_steps": -1}
  with pytest.raises(run_spec.ConfigError, match="checkpoint.every_steps"):
    run_spec.build(config)
  config.checkpoint = {"evry_steps": 1}
  with pytest.raises(run_spec.ConfigError, match=r"config.checkpoint: unknown key\(s\)"):
    run_spec.build(config)


def test_a_missing_checkpoint_folder_is_named(tmp_path):
  config = tiny.load_config("arith", "tiny")
  for key in ("resume_from", "init_from"):
    config.checkpoint = {key: str(tmp_path / "nowhere")}
    with pytest.raises(FileNotFoundError, match=f"checkpoint.{key}=.*nowhere.*no such folder"):
      run_lib.run(config, str(tmp_path / "run"), print_fn=lambda *_: None)


def _final_state(workdir):
  """`(step, leaves)` of a workdir's latest checkpoint, restored as saved."""
  manager = ocp.CheckpointManager(str(workdir / "checkpoints"), item_names=("state", "run"))
  step = manager.latest_step()
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  return step, jax.tree.leaves(restored["state"])


def test_a_resumed_synchronous_run_ends_with_the_same_parameters(tmp_path):
  """Deterministic settings (synchronous, drain): stopping after 3 updates and
  resuming gives bit-for-bit the parameters of an uninterrupted run, because
  the groups unfinished at the save are dispatched again with their group ids;
  the resume falls in the middle of a learning-rate schedule (warm-up 0-1,
  cosine decay 2-4), which goes on where it was."""
  base = tiny.load_config("arith", "tiny")
  base.learner.update(lr_schedule="cosine", lr_warmup_steps=2, lr_decay_steps=3,
                      lr_min=0.1 * base.learner.lr)
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
  resumed = run_lib.run(base, str(tmp_path / "split"), print_fn=lines.append)
  assert any("resumed from" in line and "version 3" in line for line in lines)
  rate = optim_lib.learning_rate(optim_lib.OptimConfig(
      lr=base.learner.lr, lr_schedule="cosine", lr_warmup_steps=2, lr_decay_steps=3,
      lr_min=0.1 * base.learner.lr), 6)
  np.testing.assert_allclose([r["lr"] for r in resumed.history], [rate(u) for u in (3, 4, 5)],
                             rtol=1e-6)
  step_a, whole = _final_state(tmp_path / "whole")
  step_b, split = _final_state(tmp_path / "split")
  assert step_a == step_b == 6
  for a, b in zip(whole, split):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_async_resume_loses_no_prompt_and_repeats_none(tmp_path):
  """Groups in flight or buffered at the save go on after the resume with
  what they had sampled: every prompt drawn before the save is trained once
  (or dropped by the staleness rule), none twice."""
  config = tiny.load_config("arith", "tiny")
  config.orchestrator.update(max_async_level=2, max_off_policy_steps=8)
  config.eval_every = 0
  config.num_steps = 3
  config.checkpoint = {"save_final": True}
  first = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None, keep_batches=True)
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), item_names=("state", "run"))
  record = manager.restore(3, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
  unfinished = [g["prompt"]["prompt_id"] for g in record["work"]["groups"]]
  assert unfinished, "the async run had nothing in flight at the save"
  config.num_steps = 7
  second = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None, keep_batches=True)
  trained_first = [p for b in first.trained_batches for p in b["prompt_ids"]]
  trained_second = [p for b in second.trained_batches for p in b["prompt_ids"]]
  trained = trained_first + trained_second
  assert len(trained) == len(set(trained))  # one epoch of 90 prompts: nothing repeats
  assert not set(unfinished) & set(trained_first)
  assert set(unfinished) <= set(trained_second)  # nothing in flight at the save was lost
  assert record["work"]["prompts_drawn"] == len(trained_first) + len(unfinished)
  assert _trained_as_saved(record, second, config)["tokens"] > 0
  # Drop and task accounting continues across the resume instead of restarting.
  with open(tmp_path / "metrics.jsonl") as f:
    last = [json.loads(line) for line in f if '"phase": "rl"' in line][-1]
  assert last["tasks_seen"] >= len(set(trained)) > len(set(trained_second))


def _trained_as_saved(record, resumed, config) -> collections.Counter:
  """Checks that what each saved episode had sampled (and observed) before
  the save is the start of what the resumed run trained for it: continued,
  not sampled again. Returns counts: tokens kept, episodes per restart point."""
  g, p = config.orchestrator.group_size, config.sampler.prompt_len
  rows = {(gid, s): (batch["tokens"][j * g + s, p:], batch["behaviour_logprobs"][j * g + s, p:],
                     batch["token_versions"][j * g + s, p:])
          for batch in resumed.trained_batches for j, gid in enumerate(batch["group_ids"])
          for s in range(g)}
  counts = collections.Counter()
  for saved in record["work"]["groups"]:
    for s, episode in enumerate(saved["episodes"]):
      if (saved["group_id"], s) not in rows:
        continue  # dropped as stale after the resume
      opened = episode.get("open", {"tokens": [], "logprobs": [], "versions": []})
      tokens, logprobs, versions = rows[(saved["group_id"], s)]
      n = len(episode["completion_ids"]) + len(opened["tokens"])
      np.testing.assert_array_equal(tokens[:n], episode["completion_ids"] + opened["tokens"])
      np.testing.assert_array_equal(versions[:n], episode["versions"] + opened["versions"])
      np.testing.assert_array_equal(logprobs[:n],
                                    np.float32(episode["logprobs"] + opened["logprobs"]))
      counts["tokens"] += n
      counts["open_tokens"] += len(opened["tokens"])
      counts["observed_tokens"] += episode["loss_mask"].count(0.0)
      counts[episode["stage"]] += 1
  return counts


def test_a_multi_turn_resume_continues_episodes_between_tool_calls(tmp_path):
  """Tool calls outlast updates, so the save finds episodes at every restart
  point (scored, at their environment, at the sampler with observations in
  their transcript); the resumed run trains them from there."""
  config = tiny.load_config("tool_agent", "tiny")  # warmed up to call the tool
  config.eval_every = 0
  config.env.update(latency_median_s=0.05, latency_p99_s=0.3, latency_max_s=0.5)
  config.num_steps = 4
  config.checkpoint = {"save_final": True}
  run_lib.run(config, str(tmp_path), print_fn=lambda *_: None)
  config.num_steps = 7
  lines = []
  resumed = run_lib.run(config, str(tmp_path), print_fn=lines.append, keep_batches=True)
  assert any("resumed from" in line for line in lines), lines[:3]
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), item_names=("state", "run"))
  record = manager.restore(4, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
  counts = _trained_as_saved(record, resumed, config)
  assert counts["tokens"] > 0 and counts["observed_tokens"] > 0, counts
  assert counts["env"] + counts["sample"] > 0, counts


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


def test_init_from_starts_a_new_run_from_another_runs_params(tmp_path):
  """Restore order, third place: the params of `checkpoint.init_from` (version
  0, a fresh optimizer and prompt stream) when there is nothing to resume."""
  config = tiny.load_config("arith", "tiny")
  config.eval_every = 0
  config.num_steps = 2
  config.checkpoint = {"save_final": True}
  run_lib.run(config, str(tmp_path / "a"), print_fn=lambda *_: None)
  config.num_steps = 1
  config.warmup.steps = 0
  config.checkpoint = {"init_from": str(tmp_path / "a" / "checkpoints")}
  lines = []
  result = run_lib.run(config, str(tmp_path / "b"), print_fn=lines.append, keep_batches=True)
  assert any(line.startswith("initialised params from") for line in lines)
  (batch,) = result.trained_batches
  assert batch["batch_version"] == 0
  # Run b's version 0 is run a's version 2: its first samples carry a's log-probs.
  spec = run_spec.build(config)
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  graphdef, scratch, _ = init_lib.init_params(spec.model, meshes.learner,
                                              rules_lib.LEARNER_RULES, spec.run.seed)
  reader = checkpointing.Checkpointer(str(tmp_path / "a" / "checkpoints"),
                                      checkpointing.CheckpointConfig())
  trained = reader.restore_params(checkpointing.abstract_like(
      scratch, jax.tree.map(lambda x: x.sharding, scratch)))
  sampled = batch["loss_mask"] > 0
  for params, close in ((trained, True), (scratch, False)):
    logp = slots_lib.teacher_forced_logprobs(graphdef, params, batch["tokens"],
                                             batch["token_mask"])
    assert np.allclose(logp[sampled], batch["behaviour_logprobs"][sampled], atol=1e-5) == close
