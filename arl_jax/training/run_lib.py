"""`run(config, workdir)`: one asynchronous RL run, as a page.

Build (spec, meshes, inputs), take the workdir, decide where to start
(`training/start.py`), warm up on a fresh start, then either lead (the
orchestrator, the rollout side and the learner loop: `training/learner_loop.py`)
or, in a multi-controller run's other processes, follow process 0
(`training/follower.py`). Threads: the sampler engine and the env workers
run beside this (the calling) thread, which is the learner.

Signals (SIGINT, SIGTERM) only ask for a stop (`training/stop.py`); the loop
stops at its next safe point through one stop sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections

from arl_jax.config import inputs as inputs_lib
from arl_jax.config import run_spec
from arl_jax.core import compile_cache
from arl_jax.core import schedule as schedule_lib
from arl_jax.distributed import lockstep, shard_batch
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import publish as publish_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.learner import update as update_lib
from arl_jax.metrics import host_memory, memory_ledger, memory_log
from arl_jax.metrics import startup as startup_lib
from arl_jax.metrics import writer as writer_lib
from arl_jax.models import init_lib
from arl_jax.models import lora as lora_lib
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.orchestrator import schedule_follow
from arl_jax.sampler import schedule_tap
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib
from arl_jax.training import (
  dry_run,
  evaluation,
  follower,
  learner_loop,
  records,
  rollouts,
  run_context,
  start,
  warmup_phase,
  workdir_lock,
)
from arl_jax.training import eval_log as eval_log_lib
from arl_jax.training import stop as stop_lib


@dataclasses.dataclass
class RunResult:
  """What a run did, for tests and sweeps.

  Attributes:
    history: this run's update rows, read back from `metrics.jsonl` (those of
      the updates it ran: from its starting version on).
    eval_history: its evaluation rows (a sampled pass that ran beside training
      has a row of its own, without `eval_reward`: `training/eval_log.py`).
    groups_trained: groups trained since the run began (resumes included).
    final_version: the last version trained.
    trained_batches: batch summaries (with `keep_batches`).
    wall_seconds: wall time of `run`.
    complete: every update ran (or the data ran out): a rerun would train no
      more. False when a stop request (SIGTERM, Ctrl-C) ended the run early;
      `arl_jax.launch` then exits with `EXIT_STOPPED`.
    stop_reason: what stopped it early ("signal SIGTERM"), or "".
    saved_version: the newest checkpoint of the workdir when the run ended
      (what a rerun resumes from), or None.
  """

  history: list[dict]
  eval_history: list[dict]
  groups_trained: int
  final_version: int
  trained_batches: list[dict] = dataclasses.field(default_factory=list)
  wall_seconds: float = 0.0
  complete: bool = True
  stop_reason: str = ""
  saved_version: int | None = None


def run(config: ml_collections.ConfigDict, workdir: str, *, print_fn=writer_lib.print_line,
        keep_batches: bool = False, stop: stop_lib.StopRequest | None = None,
        started_at: float | None = None) -> RunResult:
  """Trains as configured; writes `metrics.jsonl` and `groups.jsonl` to `workdir`.

  Args:
    config: experiment config (validated here before anything is compiled).
    workdir: output folder (one run at a time: it is locked).
    print_fn: where progress lines go.
    keep_batches: keep each step's host TrainBatch summary in the result
      (tests use it to check versions and lags).
    stop: the stop request the caller installed (`launch` does, before
      anything is imported, so that no signal falls between two handlers);
      None: the run installs its own for its duration.
    started_at: `time.monotonic()` when the process began (the launcher's
      first line), so the first progress line's startup phases include the
      imports; None: they start here.

  Raises:
    run_spec.ConfigError: for a bad config, before anything runs.
    workdir_lock.WorkdirInUse: another run holds `workdir`.
  """
  start_time = time.monotonic()
  programs = compile_cache.ProgramCounter()  # (counting from the `with` below)
  windows = host_memory.PeakWindows()
  memory = memory_log.MemoryLog(memory_ledger.Ledger(), windows)
  clock = startup_lib.StartupClock(started_at, programs=programs, memory=windows,
                                   memory_log=memory)
  resolved = run_spec.resolve(config)
  spec, inputs = resolved.spec, resolved.inputs
  memory.release = spec.run.release_host_memory
  cache_folder = compile_cache.enable(spec.run.compilation_cache)
  config_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  # Multi-controller (jax.distributed): process 0 leads (orchestrator, logs);
  # the others follow its decisions in lockstep and sample for it.
  leader = lockstep.is_leader()
  log_dir = workdir if leader else os.path.join(workdir, f"process_{jax.process_index()}")
  if not leader:
    print_fn = functools.partial(_prefixed, print_fn, f"[process {jax.process_index()}] ")
  os.makedirs(log_dir, exist_ok=True)
  with (workdir_lock.WorkdirLock(log_dir) as lock, programs,
        contextlib.nullcontext(stop) if stop is not None else stop_lib.StopRequest() as stop):
    stop.decides = leader
    if lock.previous_holder:
      holder = lock.previous_holder
      print_fn(f"note: the previous run in this workdir (process {holder.get('pid')} on "
               f"{holder.get('host')}, started {holder.get('started')}) did not stop cleanly")
    _print_header(spec, meshes, inputs, print_fn)
    print_fn(compile_cache.describe(cache_folder))
    checkpoints = start.open_checkpoints(spec.checkpoint, workdir)
    try:
      optimizer = optim_lib.make_optimizer(spec.optim, spec.run.num_steps,
                                           spec.loss.optimizer_steps)
      beginning = start.begin(spec, meshes.learner, checkpoints, optimizer=optimizer,
                              config=config_dict, set_aside=leader, print_fn=print_fn)
      # (a LoRA run's base is the frozen base's, declared once the learner is)
      memory.ledger.hold("learner params", beginning, lambda b: lora_lib.split(b.params)[0])
      memory.ledger.hold("frozen base", beginning, lambda b: lora_lib.split(b.params)[1])
      if leader:  # (the other processes' records hold only their evaluations)
        _follow_records(log_dir, beginning, print_fn)
      writer = writer_lib.make_writer(log_dir, spec.run.writer_names, run_config=config_dict)
      # What happened to every group: trained at a version, or dropped (and why).
      audit = writer_lib.JsonlWriter(log_dir, "groups.jsonl")
      # Who holds the memory at the end of each phase (`metrics/memory_log.py`).
      memory_writer = writer_lib.JsonlWriter(log_dir, "memory.jsonl")
      # The run's schedule (`replay.record`), beside its checkpoints.
      schedule = schedule_lib.Log(log_dir) if leader and spec.replay.record else None
      memory.open(memory_writer.write)
      memory_writer.write(_plan_row(spec))
      try:
        eval_log = _eval_log(spec, meshes, inputs, beginning.graphdef, memory.ledger,
                             writer=writer, print_fn=print_fn, start_time=start_time)
        clock.mark("build")
        context = run_context.RunContext(
            spec=spec, config=config_dict, meshes=meshes, inputs=inputs,
            graphdef=beginning.graphdef, workdir=workdir, checkpoints=checkpoints,
            eval_log=eval_log, writer=writer, audit=audit, stop=stop, clock=clock,
            memory=memory, print_fn=print_fn, keep_batches=keep_batches, schedule=schedule)
        result = _train(context, beginning, optimizer)
      finally:
        writer.close()
        audit.close()
        memory_writer.close()
        if schedule is not None:
          schedule.close()
      saved = (checkpoints.saver or checkpoints.resume)
      saved_version = None if saved is None else saved.latest_step()
      if not result.complete:
        print_fn(_stopped_line(spec, result, workdir, saved_version))
    finally:
      checkpoints.close()
  return RunResult(history=records.step_rows(log_dir, first_step=beginning.version),
                   eval_history=eval_log.history,
                   groups_trained=result.groups_trained, final_version=result.version,
                   trained_batches=result.batches, wall_seconds=time.monotonic() - start_time,
                   complete=result.complete, stop_reason=result.stop_reason,
                   saved_version=saved_version)


def _stopped_line(spec, result: learner_loop.LoopResult, workdir: str,
                  saved_version: int | None) -> str:
  """The last line of a run a stop request ended early: where a rerun starts."""
  head = (f"stopped at version {result.version} of {spec.run.num_steps} "
          f"({result.stop_reason or 'stop requested'}): ")
  if saved_version is None:
    why = ("nothing was saved yet" if spec.checkpoint.enabled else
           "checkpoint.save_final and checkpoint.every_steps are off")
    return head + f"not resumable ({why}): the same command starts over"
  return head + (f"resumable: the same command with --workdir={workdir} resumes from the "
                 f"checkpoint of version {saved_version}")


def _train(run: run_context.RunContext, beginning: start.Beginning,
           optimizer) -> learner_loop.LoopResult:
  """Warm-up (on a fresh start), the learner's state and update, then lead or follow."""
  spec = run.spec
  params, restored = beginning.params, beginning.restored
  if restored is None:
    for record in inputs_lib.skipped_records(run.inputs):
      run.writer.write(record)
    if spec.warmup.steps:
      params, finished = warmup_phase.warm_up(run, params)
      run.clock.mark("warm-up")
      if not finished:
        return learner_loop.LoopResult(version=0, groups_trained=0, batches=[], complete=False,
                                       stop_reason=run.stop.reason)
  # What trains (the whole model, or a LoRA run's adapters) and what stays.
  trainable, frozen = lora_lib.split(params)
  if restored is None:
    state, state_shardings = train_state_lib.create(trainable, optimizer, run.meshes.learner)
  else:
    state, state_shardings = restored.state, beginning.state_shardings
  # The KL penalty's reference policy: the params RL started from (after any
  # warm-up), a copy the donated update step never touches.
  reference = None
  if spec.loss.objective.kl_coef > 0:
    reference = (restored.reference if restored is not None and restored.reference is not None
                 else jax.tree.map(jnp.copy, state.params))
  update_fn = update_lib.make_update_fn(graphdef=run.graphdef, optimizer=optimizer,
                                        settings=spec.loss, state_shardings=state_shardings,
                                        mesh=run.meshes.learner, reference_params=reference,
                                        frozen=frozen,
                                        # (every process: one program across the mesh)
                                        fingerprint_params=spec.replay.record
                                        or bool(spec.replay.from_run))
  run.clock.mark("build")
  if restored is None:  # (a resumed run's records hold this evaluation already)
    run.eval_log(lora_lib.merge(state.params, frozen), 0, "rl")
    run.clock.mark("eval")
  _, abstract_state = init_lib.abstract_model(spec.model)
  publisher = publish_lib.WeightPublisher(
      run.meshes.learner, rules_lib.state_shardings(abstract_state, run.meshes.sampler,
                                                    rules_lib.SAMPLER_RULES),
      dtype=spec.sampler_model.param_dtype,
      frozen=frozen if jax.tree.leaves(frozen) else None,
      keep_versions=bool(spec.replay.from_run))
  learner = run_context.Learner(state=state, update_fn=update_fn, publisher=publisher,
                                reference=reference, version=beginning.version, frozen=frozen,
                                base=beginning.base)
  _declare_memory(run.memory.ledger, learner)
  if not lockstep.is_leader():
    complete = follower.follow(run, learner)
    run.print_fn(f"{'done' if complete else 'stopped'}: {learner.version} updates (following "
                 "process 0)")
    return learner_loop.LoopResult(version=learner.version, groups_trained=0, batches=[],
                                   complete=complete,
                                   stop_reason="" if complete else "process 0 stopped the run")
  return _lead(run, learner, restored)


def _plan_row(spec) -> dict:
  """`memory.jsonl`'s first row: what `--dry_run` plans for this run (a plan
  it cannot make is said there; the run goes on)."""
  try:
    return dry_run.plan(spec, jax.device_count(), cpu=jax.default_backend() == "cpu").record()
  except ValueError as e:
    return {"phase": "plan", "error": str(e)}


def _declare_memory(ledger: memory_ledger.Ledger, learner: run_context.Learner) -> None:
  """What the learner's side holds, for the run's memory ledger (the
  sampler engine and the evaluation declare their own)."""
  ledger.hold("learner params", learner, lambda lrn: lrn.state.params)
  ledger.hold("optimizer state", learner, lambda lrn: (lrn.state.opt_state, lrn.state.step))
  ledger.hold("kl reference", learner, lambda lrn: lrn.reference)
  ledger.hold("frozen base", learner, lambda lrn: lrn.frozen)
  # (the newest version as published, and a LoRA run's base on the sampler mesh)
  ledger.hold("sampler params", learner.publisher,
              lambda p: (p.latest_trained()[1:], p.frozen_base))


def _follow_records(log_dir: str, beginning: start.Beginning, print_fn) -> None:
  """Sets aside the record lines a resumed (or restarted) run writes again:
  those after its checkpoint's positions, or every line on a fresh start."""
  restored = beginning.restored
  if restored is None:
    records.reconcile_and_report(log_dir, None, print_fn=print_fn,
                                 reason="the run started over (nothing saved of the earlier one)")
  elif beginning.own and "records" in restored.run:  # (format 2 saved no positions)
    records.reconcile_and_report(log_dir, restored.run["records"], print_fn=print_fn,
                                 reason=f"the run resumed from version {beginning.version}")


def _eval_log(spec, meshes, inputs, graphdef, ledger, **kwargs) -> eval_log_lib.EvalLog:
  """The run's evaluation. One controller: the sampled pass on the sampler
  mesh, in the sampler's dtype, beside training for published versions
  (`training/sampled_eval.py`). Several: both passes on the learner mesh, in
  the lockstep of every process (a pass on one process's own would race the
  others' programs)."""
  if not (spec.run.eval_size and spec.run.eval_every):
    return eval_log_lib.EvalLog(None, **kwargs)
  single = not lockstep.is_multi_controller()
  evaluator = evaluation.Evaluator(
      graphdef=graphdef, model_cfg=spec.model, tokenizer=inputs.tokenizer,
      prompts=inputs.eval_prompts, env=inputs.eval_env, mesh=meshes.learner,
      engine_cfg=spec.engine, samples=spec.run.eval_samples, temperature=spec.run.eval_temperature,
      solved_reward=spec.run.eval_solved_reward, slots=spec.run.eval_slots,
      sampled_mesh=meshes.sampler if single else meshes.learner,
      sampled_model_cfg=spec.sampler_model if single else spec.model)
  evaluator.declare_memory(ledger)
  place = None
  if single and spec.run.eval_samples:
    _, abstract_state = init_lib.abstract_model(spec.model)
    place = publish_lib.Mover(meshes.learner, rules_lib.state_shardings(
        abstract_state, meshes.sampler, rules_lib.SAMPLER_RULES),
        dtype=spec.sampler_model.param_dtype)
  return eval_log_lib.EvalLog(evaluator, place_sampled=place, background=single, **kwargs)


def _lead(run: run_context.RunContext, learner: run_context.Learner,
          restored) -> learner_loop.LoopResult:
  """Process 0: the orchestrator, the rollout side and the learner loop."""
  spec, env = run.spec, run.inputs.env
  work = restored.run["work"] if restored is not None else None
  keeper, tap = _schedule_parts(run, learner)
  orchestrator = orchestrator_lib.Orchestrator(
      spec.orchestrator, prompts=inputs_lib.prompt_stream(spec, run.inputs, work),
      encode_fn=env.encode_prompt, env_name_of=env.env_name_of,
      max_new_tokens=spec.engine.max_new_tokens, budget_fn=env.max_new_tokens_for,
      audit_fn=run.audit.write, keeper=keeper)
  multi = lockstep.is_multi_controller()
  sampling = rollouts.build(run, orchestrator=orchestrator, publisher=learner.publisher,
                            multi_controller=multi, tap=tap)
  broadcast_fn = shards = None
  if multi:
    lockstep.share_text(sampling.fleet.address, run.meshes.learner)
    broadcast_fn = lockstep.leader_broadcast_fn(sampling.fleet, run.meshes.learner)
    shards = shard_batch.LeaderShards(spec, mesh=run.meshes.learner, fleet=sampling.fleet,
                                      is_open=orchestrator.work.is_open, pad_id=run.pad_id)
  groups_trained = 0
  if restored is not None:
    run.audit.write({"event": "resumed", "version": learner.version})
    saved = {"work": work, "drop_ledger": restored.run["drop_ledger"]}
    if "staleness" in restored.run:  # (checkpoints before the adaptive bound lack it)
      saved["staleness"] = restored.run["staleness"]
    reopened = orchestrator.restore(saved)
    counters = restored.run["counters"]
    sampling.load_state_dict(counters["rollouts"])
    groups_trained = int(counters["groups_trained"])
  learner.publisher.publish(learner.state.params, learner.version)
  if restored is not None and restored.run.get("sampled_eval_pending") == learner.version:
    run.eval_log.resume_sampled(learner.version, "rl", learner.publisher.latest()[1])
  # The publish of the starting version: nothing to cancel on a fresh start
  # or a resume from format 3 (its snapshot follows the publish); a format-2
  # snapshot was taken before it, so its cancellations happen again here.
  cancelled = set(orchestrator.publish(learner.version, trained=[]))
  sampling.cancel(cancelled)
  if restored is not None:
    sampling.restore([g for g in reopened if g.group_id not in cancelled])
  run.clock.mark("build")
  sampling.start()  # (a local engine compiles its programs first: sampler.precompile)
  run.clock.mark("compile")
  loop = learner_loop.LearnerLoop(
      run, learner, orchestrator=orchestrator, rollouts=sampling,
      groups_trained=groups_trained, broadcast_fn=broadcast_fn, shards=shards,
      start_saved=restored is not None or not spec.warmup.steps, keeper=keeper)
  result = loop.run()
  sampling.raise_if_failed()
  _write_task_drops(run.workdir, orchestrator.ledger)
  drops = orchestrator.ledger.metrics()
  run.print_fn(
      f"{'done' if result.complete else 'stopped'}: {result.version} updates, final "
      f"version {result.version}, "
      f"{result.groups_trained} groups trained; dropped rollouts: {drops['dropped_stale']} "
      f"stale, {drops['dropped_cancelled']} cancelled in flight, "
      f"{drops['dropped_env_error']} env errors, {drops['dropped_truncated']} truncated"
      + (f", {drops['dropped_zero_variance']} in groups of equal rewards"
         if drops['dropped_zero_variance'] else "") + "; "
      f"{drops['tasks_lost']} of {drops['tasks_seen']} tasks never trained"
      + _peak_note(run, result.version))
  return result


def _schedule_parts(run: run_context.RunContext, learner: run_context.Learner):
  """`(keeper, engine tap)` recording this run's schedule, or following the
  segment of a recorded one that starts at this run's version; `(None,
  None)` for neither."""
  if run.schedule is not None:
    run.schedule.write("segment", v=learner.version)
    return (schedule_follow.Keeper(log=run.schedule), schedule_tap.EngineTap(log=run.schedule))
  source = run.spec.replay.from_run
  if not source:
    return None, None
  segment, ends_at = schedule_lib.segment_at(schedule_lib.load(source), learner.version, source)
  run.print_fn(f"replay: following {source}'s schedule from version {learner.version}"
               + ("" if ends_at is None else f" to its resume at version {ends_at}"))
  return (schedule_follow.Keeper(segment=segment),
          schedule_tap.EngineTap(segment=segment, params_fn=learner.publisher.published))


def _peak_note(run: run_context.RunContext, version: int) -> str:
  """`; host peak 11.0 GiB` (the whole run's resident peak), where measured."""
  run.memory.note("stop", version)  # (the last window: since the last update)
  overall = run.clock.memory.overall
  return "" if overall is None else f"; host peak {overall / 1024**3:.1f} GiB"


def _print_header(spec, meshes, inputs, print_fn) -> None:
  placement = ("remote samplers" if spec.fleet.remote else
               "colocated" if meshes.colocated else "disaggregated")
  print_fn(f"arl_jax: {spec.model.num_params / 1e6:.2f}M params | learner mesh "
           f"{dict(meshes.learner.shape)} | sampler mesh {dict(meshes.sampler.shape)} | "
           f"{placement} | K={spec.orchestrator.max_off_policy_steps} max_async_level="
           f"{spec.orchestrator.max_async_level} | {len(inputs.train.prompts)} train / "
           f"{len(inputs.eval_prompts)} eval prompts")
  engine = spec.engine
  print_fn(f"sampler: {engine.num_slots} slots of {engine.length} columns, kv_cache="
           f"{engine.kv_cache}, decode_burst={engine.decode_burst}, precompile="
           f"{engine.precompile}" + (f" | chosen: {'; '.join(spec.choices)}" if spec.choices
                                     else ""))
  for line in inputs_lib.warnings(spec, inputs):
    print_fn(line)


def _prefixed(print_fn, prefix: str, line: str) -> None:
  print_fn(prefix + line)


def _write_task_drops(workdir: str, ledger) -> None:
  """`task_drops.json`: every task that lost a group, worst drop rate first."""
  with open(os.path.join(workdir, "task_drops.json"), "w", encoding="utf-8") as f:
    json.dump(ledger.task_table(), f, indent=1)
