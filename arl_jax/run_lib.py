"""`run(config, workdir)`: wires the components of one asynchronous RL run.

Threads (DESIGN.md section 2): the sampler engine generates on the sampler mesh,
env workers score finished groups, and this (the calling) thread is the
learner: it cuts a batch from the buffer (after the staleness sweep), applies
the jitted update on the learner mesh, publishes the new version device to
device, and cancels groups that can no longer ship.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from arl_jax import checkpointing, config_lib, evaluation
from arl_jax import train_batch as train_batch_lib
from arl_jax.distributed import fleet as fleet_lib
from arl_jax.distributed import follower, lockstep
from arl_jax.envs import env_api, prompt_data, prompt_source, registry
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import publish as publish_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.learner import update as update_lib
from arl_jax.learner import warmup as warmup_lib
from arl_jax.metrics import writer as writer_lib
from arl_jax.models import hf_params, init_lib
from arl_jax.orchestrator import env_runner as env_runner_lib
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.sampler import engine as engine_lib
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib


@dataclasses.dataclass
class RunResult:
  """What a run did, for tests and sweeps."""

  history: list[dict]
  eval_history: list[dict]
  groups_trained: int
  final_version: int
  trained_batches: list[dict] = dataclasses.field(default_factory=list)
  wall_seconds: float = 0.0


def run(config: ml_collections.ConfigDict, workdir: str, *, print_fn=writer_lib.print_line,
        keep_batches: bool = False) -> RunResult:
  """Trains as configured; writes `metrics.jsonl` to `workdir`.

  Args:
    config: experiment config (validated here before anything is compiled).
    workdir: output folder.
    print_fn: where progress lines go.
    keep_batches: keep each step's host TrainBatch summary in the result
      (tests use it to check versions and lags).
  """
  start_time = time.monotonic()
  spec = config_lib.build(config)
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  # Multi-controller (jax.distributed): process 0 leads (orchestrator, logs);
  # the others follow its decisions in lockstep and sample for it.
  multi, leader = lockstep.is_multi_controller(), lockstep.is_leader()
  log_dir = workdir
  if not leader:
    log_dir = os.path.join(workdir, f"process_{jax.process_index()}")
    os.makedirs(log_dir, exist_ok=True)
    print_fn = functools.partial(_prefixed, print_fn, f"[process {jax.process_index()}] ")
  tokenizer = tokenizer_lib.make_tokenizer(spec.tokenizer)
  env_entry = registry.ENVS[spec.env_name]
  env = env_entry.make_env_fn(spec.env, tokenizer)
  train = prompt_source.load(spec.env_name, spec.env, spec.data, "train")
  heldout_source = prompt_source.load(spec.env_name, spec.env, spec.data, "heldout")
  train_prompts, heldout = train.prompts, heldout_source.prompts
  eval_prompts = _eval_prompts(env, heldout, spec.eval_size)
  # What happened to every group: trained at a version, or dropped (and why).
  audit = writer_lib.JsonlWriter(log_dir, "groups.jsonl")
  writer = writer_lib.make_writer(
      log_dir, spec.writers, run_config=config.to_dict() if hasattr(config, "to_dict") else config)
  placement = ("remote samplers" if spec.fleet.remote else
               "colocated" if meshes.colocated else "disaggregated")
  print_fn(f"arl_jax: {spec.model.num_params / 1e6:.2f}M params | learner mesh "
           f"{dict(meshes.learner.shape)} | sampler mesh {dict(meshes.sampler.shape)} | "
           f"{placement} | K="
           f"{spec.dispatch.max_off_policy_steps} max_async_level="
           f"{spec.dispatch.max_async_level} | {len(train_prompts)} train / "
           f"{len(eval_prompts)} eval prompts")
  if spec.data.train_path and not spec.data.heldout_path:
    print_fn("warning: data.train_path is set but data.heldout_path is not: evaluation uses "
             f"env {spec.env_name!r}'s own held-out prompts, which may overlap your training "
             "file")
  for split, source in (("train", train), ("heldout", heldout_source)):
    if source.skipped:
      print_fn(f"warning: skipped {len(source.skipped)} malformed {split} line(s), first: "
               f"{source.skipped[0]}")
      writer.write({"phase": "data", "split": split, "skipped_lines": len(source.skipped),
                    "skipped": source.skipped[:100]})
  if spec.dispatch.max_async_level > spec.dispatch.max_off_policy_steps:
    print_fn(f"warning: max_async_level={spec.dispatch.max_async_level} > K="
             f"{spec.dispatch.max_off_policy_steps}: the sampler may run further ahead than "
             f"groups may lag, so expect many stale drops and cancellations")

  # Restore order: this workdir's latest checkpoint, then checkpoint.resume_from
  # (both restored below, onto the layout of these params), then the params of
  # checkpoint.init_from, then model.hf_path's weights, then a random init.
  checkpointer, resume = _checkpoints(spec.checkpoint, workdir)
  graphdef, params = _initial_params(spec, meshes.learner, resume is not None, print_fn)
  _, abstract_state = init_lib.abstract_model(spec.model)
  sampler_shardings = rules_lib.state_shardings(abstract_state, meshes.sampler,
                                                rules_lib.SAMPLER_RULES)
  evaluator = None
  if spec.eval_size and spec.eval_every:
    evaluator = evaluation.Evaluator(
        graphdef=graphdef, model_cfg=spec.model, tokenizer=tokenizer, prompts=eval_prompts,
        env=env_entry.make_env_fn(spec.env, tokenizer, for_eval=True), mesh=meshes.learner,
        engine_cfg=spec.engine)
  eval_history: list[dict] = []

  def evaluate(step: int, phase: str) -> float | None:
    # (Multi-controller: every process runs it, on the learner mesh, in step.)
    if evaluator is None:
      return None
    result = evaluator(params_now())
    now = time.monotonic()
    record = {"phase": phase, "step": step, "eval_reward": result.reward,
              "eval_reward_by_env": result.reward_by_env, "wall_s": now - start_time}
    if phase == "rl":  # on the RL clock of the step records (0 before the first update)
      record["rl_wall_s"] = now - clock["rl_start"] if clock["rl_start"] is not None else 0.0
    eval_history.append(record)
    writer.write(record)
    sample = "; ".join(f"{p}{c!r}" for p, c in result.examples)
    print_fn(f"eval [{phase} step {step}] reward {result.reward:.3f} on {result.num_prompts} "
             f"held-out prompts ({sample})")
    return result.reward

  holder = {"params": params}
  clock = {"rl_start": None}
  params_now = lambda: holder["params"]

  if spec.warmup.steps and resume is None:
    evaluate(0, "warmup")
    w = spec.warmup
    num_chosen = max(1, int(w.fraction * len(train_prompts)))
    subset = np.random.default_rng((spec.seed, 0)).permutation(len(train_prompts))[:num_chosen]
    chosen = [train_prompts[i] for i in subset]

    def log_warmup(step, metrics):
      writer.write({"phase": "warmup", "step": step, **metrics})
      print_fn(f"warmup {step:>4d} | loss {float(metrics['loss']):.4f}")

    holder["params"] = warmup_lib.run_warmup(
        params=params, graphdef=graphdef, mesh=meshes.learner,
        optimizer=optim_lib.make_optimizer(optim_lib.OptimConfig(lr=w.lr)), steps=w.steps,
        batch_size=w.batch_size, prompt_ids=[env.encode_prompt(p) for p in chosen],
        demonstrations=[env.demonstration(p) for p in chosen], prompt_len=spec.engine.prompt_len,
        max_new_tokens=spec.engine.max_new_tokens, pad_id=tokenizer.pad_id, seed=spec.seed,
        log_fn=log_warmup)

  optimizer = optim_lib.make_optimizer(spec.optim)
  state, state_shardings = train_state_lib.create(holder["params"], optimizer, meshes.learner)
  start_step, record = 0, None
  if resume is not None:
    state, record = resume.restore(checkpointing.abstract_like(state, state_shardings))
    start_step = int(record["version"])
    print_fn(f"resumed from {resume.directory} at version {start_step}: "
             f"{_describe_work(record['work'])}")
  # The KL penalty's reference policy: the params RL starts from (after any
  # warm-up), a copy that the donated update step never touches.
  reference = (jax.tree.map(jnp.copy, state.params) if spec.loss.kl_coef > 0 else None)
  if reference is not None and resume is not None:  # the start of the original run
    saved = resume.restore_reference(start_step, checkpointing.abstract_like(
        reference, state_shardings.params))
    reference = reference if saved is None else saved
  if resume is not None and resume is not checkpointer:
    resume.close()
  update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer,
                                        settings=spec.loss, state_shardings=state_shardings,
                                        mesh=meshes.learner, reference_params=reference)
  holder["params"] = state.params
  evaluate(start_step, "rl")

  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings,
                                          dtype=spec.sampler_model.param_dtype)
  if not leader:
    try:
      version = follower.follow(
          spec, meshes=meshes, graphdef=graphdef, state=state, update_fn=update_fn,
          publisher=publisher, checkpointer=checkpointer, reference=reference,
          evaluate=evaluate, holder=holder, version=start_step)
    finally:
      writer.close()
      audit.close()
    print_fn(f"done: {version} updates (following process 0)")
    return RunResult(history=[], eval_history=eval_history, groups_trained=0,
                     final_version=version, wall_seconds=time.monotonic() - start_time)
  orchestrator = orchestrator_lib.Orchestrator(
      dispatch_cfg=spec.dispatch, buffer_cfg=spec.buffer,
      prompts=_resumed_stream(
          _prompt_stream(env, train_prompts, spec.seed, spec.data.num_epochs),
          None if record is None else record["work"]),
      encode_fn=env.encode_prompt,
      env_name_of=lambda prompt: env_api.env_name_of(env, prompt),
      max_new_tokens=spec.engine.max_new_tokens,
      mask_truncated_completions=spec.mask_truncated_completions,
      budget_fn=functools.partial(env_api.budget_of, env),
      audit_fn=audit.write)
  fleet = None
  if spec.fleet.remote or multi:
    # Sampler processes join over the network (and in a multi-controller run
    # the other processes' samplers do).
    fleet = fleet_lib.SamplerFleet(
        spec.fleet, orchestrator=orchestrator, publisher=publisher,
        run_config=config.to_dict() if hasattr(config, "to_dict") else dict(config),
        sampler_mesh_shape=meshes.sampler.shape.items(), workdir=workdir, print_fn=print_fn,
        event_fn=lambda event: writer.write({"phase": "fleet", **event}))
    fleet.start()  # (before the first publish: other processes join it first)
    if multi:
      lockstep.share_text(fleet.address, meshes.learner)
  if spec.fleet.remote:
    # No sampler here: the fleet stands in for the local engine and env
    # runner (their counters, cancellations, snapshots).
    engine = env_runner = fleet
  else:
    env_runner = env_runner_lib.EnvRunner(
        env, on_group_fn=orchestrator.group_finished, max_new_tokens=spec.engine.max_new_tokens,
        num_workers=spec.num_env_workers, timeout_s=spec.env_timeout_s,
        vocab_size=spec.model.vocab_size, work=orchestrator.dispatcher.work)
    engine = engine_lib.SamplerEngine(
        cfg=spec.engine, settings=spec.sampling, graphdef=graphdef,
        model_cfg=spec.sampler_model, mesh=meshes.sampler, publisher=publisher,
        dispatcher=orchestrator.dispatcher, on_segment_fn=env_runner.submit,
        stop_ids_fn=functools.partial(env_api.segment_stop_ids, tokenizer, env))
    env_runner.connect(engine.resume)

  groups_trained = 0
  restored = []
  if record is not None:  # later audit events supersede those after the checkpoint
    audit.write({"event": "resumed", "version": start_step})
    restored = orchestrator.restore_work(record["work"])
    orchestrator.ledger.restore(record["drop_ledger"])
    groups_trained = _restore_counters(record["counters"], engine, env_runner)
  version = start_step
  publisher.publish(state.params, version)
  # On a resume: the groups this publish cancelled when the run saved, again.
  cancelled = set(orchestrator.publish(version, trained=[]))
  cancel = functools.partial(_cancel, engine, env_runner, fleet)
  cancel(cancelled)
  restored = [g for g in restored if g.group_id not in cancelled]
  if fleet is engine:
    fleet.restart([g.group_id for g in restored if g.complete is None])
  else:
    engine.restore([e for g in restored for e in g.to_sample])
    env_runner.restore([r for g in restored for r in g.scored],
                       [e for g in restored for e in g.to_env])
  engine.start()
  history: list[dict] = []
  batches: list[dict] = []
  rl_start = clock["rl_start"] = time.monotonic()
  last_time = rl_start
  learner_wait = 0.0  # seconds the learner spent waiting for a batch
  stop_requested = _StopRequest()
  saved_version = start_step
  final_eval = None  # the step to evaluate at after the loop (data exhausted)
  failed = True  # until the loop ends without an exception (then the state is valid)
  try:
    for step in range(start_step, spec.num_steps):
      if stop_requested:
        print_fn(f"stopping after {step} updates: {stop_requested.reason}")
        break
      wait_start = time.monotonic()
      try:
        batch = _cut_batch(orchestrator, (engine, env_runner, fleet), version)
      except orchestrator_lib.DataExhausted as e:
        print_fn(f"data exhausted after {step} updates (data.num_epochs="
                 f"{spec.data.num_epochs}): {e}")
        if spec.eval_every and step % spec.eval_every:
          final_eval = step  # after the other processes hear that the run stops
        break
      learner_wait += time.monotonic() - wait_start
      host_batch = train_batch_lib.assemble(
          batch.groups, batch_version=version, prompt_len=spec.engine.prompt_len,
          # Trained columns follow the batch's longest completion, not the budget.
          max_new_tokens=train_batch_lib.completion_width(batch.groups,
                                                          spec.engine.max_new_tokens),
          pad_id=tokenizer.pad_id,
          advantage_estimator=spec.advantage_estimator,
          staleness_reference=spec.buffer.staleness_reference,
          mask_truncated_completions=spec.mask_truncated_completions)
      if multi:  # every process trains on this batch
        fleet.announce(step)
        lockstep.share(lockstep.Step(lockstep.BATCH, host_batch), meshes.learner)
      state, metrics = update_fn(state, host_batch)
      version += 1
      holder["params"] = state.params
      publisher.publish(state.params, version)
      groups_trained += len(batch.groups)
      run_record, saving = None, {}
      if checkpointer is not None and checkpointer.should_save(version):
        # Before this publish retires and cancels anything (a resume repeats
        # it), leaving out the groups just trained.
        saving["start"] = time.monotonic()
        run_record = _run_record(version, orchestrator, engine, env_runner, groups_trained,
                                 exclude=[g.group_id for g in batch.groups])
      cancelled = orchestrator.publish(version, trained=batch.groups)
      if run_record is not None:
        checkpointer.save(version, state, run_record, reference)
        saved_version = version
        saving.update(
            checkpoint_blocking_s=time.monotonic() - saving.pop("start"),
            checkpoint_open_groups=len(run_record["work"]["groups"]),
            checkpoint_open_tokens=sum(len(e["completion_ids"]) + len(e.get("open", {}).get(
                "tokens", ())) for g in run_record["work"]["groups"] for e in g["episodes"]))
      cancel(cancelled)
      metrics = jax.device_get(metrics)
      now = time.monotonic()
      record = _step_record(step, version, host_batch, batch, metrics, orchestrator, engine,
                            env_runner, now - last_time, now - rl_start, learner_wait)
      # At the mean pace so far (evaluations included).
      record["eta_s"] = (now - rl_start) / (step + 1) * (spec.num_steps - step - 1)
      # Saved at this step: the learner's pause (open-work snapshot and the
      # device-to-host copy) and how much sampled work the checkpoint kept.
      record.update(saving)
      if fleet is not None:
        record.update(fleet.metrics())
      last_time = now
      if keep_batches:
        batches.append({"batch_version": batch.batch_version, "lag": host_batch.lag.copy(),
                        "token_versions": host_batch.token_versions.copy(),
                        "tokens": host_batch.tokens.copy(),
                        "token_mask": host_batch.token_mask.copy(),
                        "behaviour_logprobs": host_batch.behaviour_logprobs.copy(),
                        "loss_mask": host_batch.loss_mask.copy(),
                        "dispatch_versions": [g.dispatch_version for g in batch.groups],
                        "group_ids": [g.group_id for g in batch.groups],
                        "prompt_ids": [g.prompt_id for g in batch.groups]})
      is_last = step == spec.num_steps - 1
      if spec.eval_every and ((step + 1) % spec.eval_every == 0 or is_last):
        record["eval_reward"] = evaluate(step + 1, "rl")
      history.append(record)
      writer.write({"phase": "rl", **record})
      if spec.log_every and (step % spec.log_every == 0 or is_last or "eval_reward" in record):
        print_fn(writer_lib.progress_line(record))
    failed = False
  except KeyboardInterrupt:
    stop_requested.reason = "interrupted (Ctrl-C)"
    print_fn(f"stopping after {version} updates: {stop_requested.reason}")
    failed = False
  finally:
    # Stop everything first; a sampler or env failure is raised afterwards
    # (below), so cleanup always runs and never masks the learner's own error.
    stop_requested.restore()
    # Not after an error, nor if an interrupt hit between the donating update
    # and its result: the state's buffers may be gone.
    save_final = (checkpointer is not None and spec.checkpoint.save_final and not failed
                  and version != saved_version and not engine.failed
                  and not any(x.is_deleted() for x in jax.tree.leaves(state)))
    if multi:  # the other processes stop with us (and evaluate, save as we do)
      fleet.announce(spec.num_steps)
      lockstep.share(lockstep.Step(lockstep.STOP, evaluate=final_eval is not None and not failed,
                                   save_final=save_final), meshes.learner)
    if final_eval is not None and not failed:
      evaluate(final_eval, "rl")
    if save_final:
      checkpointer.save(version, state, _run_record(version, orchestrator, engine, env_runner,
                                                    groups_trained), reference)
    if checkpointer is not None:
      checkpointer.close()  # waits for the last asynchronous save
    orchestrator.close()
    engine.stop(raise_errors=False)
    if fleet is not None and fleet is not engine:
      fleet.stop(raise_errors=False)
    env_runner.close()
    writer.close()
    audit.close()
  engine.raise_if_failed()
  env_runner.raise_if_failed()
  if fleet is not None:
    fleet.raise_if_failed()
  wall = time.monotonic() - start_time
  _write_task_drops(workdir, orchestrator.ledger)
  drops = orchestrator.ledger.metrics()
  print_fn(f"done: {version} updates, final version {version}, {groups_trained} groups "
           f"trained; dropped rollouts: {drops['dropped_stale']} stale, "
           f"{drops['dropped_cancelled']} cancelled in flight, {drops['dropped_env_error']} env "
           f"errors, {drops['dropped_truncated']} truncated; {drops['tasks_lost']} of "
           f"{drops['tasks_seen']} tasks never trained; {wall:.1f}s wall")
  return RunResult(history=history, eval_history=eval_history, groups_trained=groups_trained,
                   final_version=version, trained_batches=batches, wall_seconds=wall)


def _prefixed(print_fn, prefix: str, line: str) -> None:
  print_fn(prefix + line)


def _cancel(engine, env_runner, fleet, group_ids) -> None:
  """Stops cancelled groups wherever they are: the local engine and env
  workers, and the sampler processes holding them."""
  engine.cancel(group_ids)
  if env_runner is not engine:
    env_runner.cancel(group_ids)
  if fleet is not None and fleet is not engine:
    fleet.cancel(group_ids)


class _StopRequest:
  """Truthy once SIGTERM arrived (a preemption): the loop stops after the
  current update and the final checkpoint is saved."""

  def __init__(self):
    self.reason = ""
    self._previous = None
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)

  def _on_signal(self, signum, frame):
    del frame
    self.reason = f"signal {signal.Signals(signum).name}"

  def __bool__(self) -> bool:
    return bool(self.reason)

  def restore(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


def _initial_params(spec, mesh, resuming: bool, print_fn):
  """`(graphdef, params)` a run starts from, laid out on the learner `mesh`:
  another checkpoint's params (`checkpoint.init_from`), else a Hugging Face
  folder's weights (`model.hf_path`), else a random init (also the template
  a resume restores onto)."""
  rules = rules_lib.LEARNER_RULES
  if not resuming and spec.checkpoint.init_from:
    init = _existing_checkpoint(spec.checkpoint.init_from, "checkpoint.init_from",
                                spec.checkpoint)
    graphdef, abstract = init_lib.abstract_model(spec.model)
    shardings = rules_lib.state_shardings(abstract, mesh, rules)
    params = init.restore_params(checkpointing.abstract_like(abstract, shardings))
    print_fn(f"initialised params from {init.directory} (step {init.latest_step()})")
    init.close()
    return graphdef, params
  if not resuming and spec.model_hf_path:
    start = time.monotonic()
    graphdef, params = hf_params.load_params(spec.model_hf_path, spec.model, mesh, rules)
    print_fn(f"imported {spec.model_hf_path} ({spec.model.num_params / 1e6:.1f}M params, "
             f"{time.monotonic() - start:.1f}s)")
    return graphdef, params
  graphdef, params, _ = init_lib.init_params(spec.model, mesh, rules, spec.seed)
  return graphdef, params


def _checkpoints(cfg: checkpointing.CheckpointConfig, workdir: str):
  """`(checkpointer to save with or None, checkpointer to resume from or None)`."""
  own = os.path.join(workdir, "checkpoints")
  saver = checkpointing.Checkpointer(own, cfg) if cfg.enabled else None
  if saver is not None and saver.latest_step() is not None:
    return saver, saver
  if not cfg.enabled and os.path.isdir(own):
    reader = checkpointing.Checkpointer(own, cfg)
    if reader.latest_step() is not None:
      return None, reader
  if cfg.resume_from:
    return saver, _existing_checkpoint(cfg.resume_from, "checkpoint.resume_from", cfg)
  return saver, None


def _existing_checkpoint(path: str, key: str, cfg) -> checkpointing.Checkpointer:
  if not os.path.isdir(path):  # (a Checkpointer would create it)
    raise FileNotFoundError(f"{key}={path!r}: no such folder")
  reader = checkpointing.Checkpointer(path, cfg)
  if reader.latest_step() is None:
    raise FileNotFoundError(f"{key}={path!r}: no checkpoint there")
  return reader


def _run_record(version: int, orchestrator, engine, env_runner, groups_trained: int,
                exclude=()) -> dict:
  """What a resume needs besides the TrainState (JSON): the policy version,
  the open work (every group in flight or in the buffer, each episode at its
  restart point, read by the sampler thread with the prompt stream's
  position: `Dispatcher.snapshot_work`), the drop ledger and the counters.
  `exclude`: the groups of the batch just trained."""
  return {
      "version": version,
      "work": engine.snapshot_work(exclude),
      "drop_ledger": orchestrator.ledger.to_json(),
      "counters": {
          "groups_trained": groups_trained,
          "env_errors": dict(env_runner.errors), "env_timeouts": dict(env_runner.timeouts),
          "env_turns": env_runner.turns,
          "cancelled_rollouts": engine.stats.cancelled_rollouts,
          "cancelled_tokens": engine.stats.cancelled_tokens,
          "cancelled_sampled_tokens": engine.stats.cancelled_sampled_tokens,
      },
  }


def _restore_counters(counters: dict, engine, env_runner) -> int:
  """Cumulative counts go on from a checkpoint's; returns groups trained."""
  env_runner.errors.update(counters["env_errors"])
  env_runner.timeouts.update(counters["env_timeouts"])
  env_runner.turns = int(counters["env_turns"])
  for name in ("cancelled_rollouts", "cancelled_tokens", "cancelled_sampled_tokens"):
    setattr(engine.stats, name, int(counters[name]))
  return int(counters["groups_trained"])


def _describe_work(work: dict) -> str:
  groups = work["groups"]
  stages = collections.Counter(e["stage"] for g in groups for e in g["episodes"])
  open_tokens = sum(len(e.get("open", {}).get("tokens", ())) for g in groups
                    for e in g["episodes"])
  return (f"{work['prompts_drawn']} prompts drawn; {len(groups)} open groups go on (rollouts: "
          f"{stages['done']} scored, {stages['env']} at their environment, {stages['sample']} "
          f"at the sampler, {open_tokens} tokens of open segments kept); "
          f"{len(work['requeued'])} requeued prompts")


def _resumed_stream(stream, work: dict | None):
  """The prompt stream where a resumed run left it: the grain iterator's saved
  position, or (for a stream without one) after the prompts drawn."""
  if work is None:
    return stream
  if work["stream_state"] is not None:
    stream.set_state(work["stream_state"])
    return stream
  return itertools.islice(stream, work["prompts_drawn"], None)


def _eval_prompts(env, heldout, size: int) -> list:
  """`size` held-out prompts spread evenly over the list, split evenly between
  the environments of a mixture."""
  by_env = collections.defaultdict(list)
  for p in heldout:
    by_env[env_api.env_name_of(env, p)].append(p)
  chosen = []
  for i, prompts in enumerate(by_env.values()):
    n = size // len(by_env) + (i < size % len(by_env))
    chosen += prompts[:: max(1, len(prompts) // max(n, 1))][:n]
  return chosen


def _prompt_stream(env, prompts, seed, num_epochs: int = 0):
  """Training prompts: one shuffled stream, or for a mixture of environments a
  stream drawing from each in proportion to its weight."""
  weights = getattr(env, "weights", None)
  # One stream for the whole run, not a shard per process: in a
  # multi-controller run only process 0's orchestrator draws prompts.
  whole = {"shard_index": 0, "shard_count": 1}
  if not weights:
    return prompt_data.prompt_iterator(prompts, seed, num_epochs=num_epochs or None, **whole)
  by_env = collections.defaultdict(list)
  for p in prompts:
    by_env[env_api.env_name_of(env, p)].append(p)
  return prompt_data.mixed_iterator(by_env, weights, seed, **whole)


def _reward_by_env(groups) -> dict[str, float]:
  rewards = collections.defaultdict(list)
  for g in groups:
    for r in g.rollouts:
      rewards[r.env_name].append(r.reward)
  return {name: float(np.mean(v)) for name, v in sorted(rewards.items())}


def _cut_batch(orchestrator, workers, version):
  """Waits for a batch, surfacing a sampler or env failure instead of waiting forever."""
  while True:
    try:
      return orchestrator.cut(version, timeout=1.0)
    except TimeoutError:
      for worker in workers:
        if worker is not None:
          worker.raise_if_failed()


def _write_task_drops(workdir: str, ledger) -> None:
  """`task_drops.json`: every task that lost a group, worst drop rate first."""
  with open(os.path.join(workdir, "task_drops.json"), "w", encoding="utf-8") as f:
    json.dump(ledger.task_table(), f, indent=1)


def _version_spread(batch) -> np.ndarray:
  """`[B]` newest minus oldest version among each row's trained tokens (0 if none)."""
  sampled = batch.loss_mask > 0
  big = np.iinfo(np.int32).max
  newest = np.where(sampled, batch.token_versions, -1).max(axis=1)
  oldest = np.where(sampled, batch.token_versions, big).min(axis=1)
  return np.where(sampled.any(axis=1), newest - oldest, 0)


def _step_record(step, version, host_batch, batch, metrics, orchestrator, engine, env_runner,
                 step_seconds, rl_seconds, learner_wait) -> dict:
  trained_tokens = float(metrics["trained_tokens"])
  rollouts = [r for g in batch.groups for r in g.rollouts]
  in_flight = [sum(r.timings.get(k, 0.0) for k in ("queued", "generating", "in_env"))
               for r in rollouts]
  in_buffer = [r.timings.get("in_buffer", 0.0) for r in rollouts]
  dispatcher = orchestrator.dispatcher
  record = {
      "step": step,
      "version": version,
      "reward_mean": float(np.mean(host_batch.rewards)),
      "reward_by_env": _reward_by_env(batch.groups),
      **batch.lag_metrics(),
      "seconds_in_flight": float(np.mean(in_flight)),
      "seconds_in_buffer": float(np.mean(in_buffer)),
      "tokens_per_s": trained_tokens / max(step_seconds, 1e-9),
      "step_seconds": step_seconds,
      "wall_s": rl_seconds,
      # This batch: groups swept as stale before it, rows masked in it.
      "stale_groups_swept": len(batch.stale),
      "masked_env_error": int(batch.masked["env_error"]),
      "masked_truncated": int(batch.masked["truncated"]),
      # Cumulative, in rollouts (drop_ledger.py).
      **orchestrator.ledger.metrics(),
      "cancelled_groups": dispatcher.num_cancelled,
      "requeued_groups": dispatcher.num_requeued,
      # Upper bound: cancelled rollouts' unsampled budget (they might have stopped earlier).
      "cancelled_tokens_saved_max": engine.stats.cancelled_tokens,
      "cancelled_tokens_discarded": engine.stats.cancelled_sampled_tokens,
      "env_errors": int(sum(env_runner.errors.values())),
      "env_timeouts": int(sum(env_runner.timeouts.values())),
      "env_turns": env_runner.turns,
      "sampler_resumes": engine.stats.resumes,
      # Rows whose trained tokens were sampled by more than one policy version.
      "multi_version_fraction": float(np.mean(_version_spread(host_batch) > 0)),
      "buffer_size": len(orchestrator.buffer),
      "in_system_groups": dispatcher.in_system,
      # Shares of the RL wall time so far: the learner not waiting for a
      # batch, the sampler thread decoding, prefilling or swapping.
      "learner_busy_fraction": 1.0 - learner_wait / max(rl_seconds, 1e-9),
      "sampler_busy_fraction": engine.stats.busy_seconds / max(rl_seconds, 1e-9),
      "sampler_busy_s": engine.stats.busy_seconds,
      "sampler_swaps": engine.stats.swaps,
      "sampler_occupancy": engine.stats.occupancy,
      "sampler_tokens_per_s": engine.stats.sampled_tokens / max(engine.stats.busy_seconds, 1e-9),
      "sampler_prefill_s": engine.stats.prefill_seconds,
      "sampler_decode_s": engine.stats.decode_seconds,
      "sampler_swap_pause_s": engine.stats.swap_seconds,
      "sampler_queue_wait_s": engine.stats.queue_wait_seconds / max(engine.stats.inserts, 1),
      "sampler_versions_held": engine.stats.max_versions_held,
  }
  record.update({k: float(v) for k, v in metrics.items()})
  return record
