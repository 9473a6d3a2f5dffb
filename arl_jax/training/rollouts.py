"""Where rollouts come from, as the learner loop sees it: one interface, two backends.

- `LocalRollouts`: this process's sampler engine (a thread on the sampler
  mesh) and its env workers; in a multi-controller run also the fleet that the
  other processes' samplers join.
- `RemoteRollouts`: sampler processes that join over ZeroMQ (`fleet.remote`);
  this process samples nothing.

Both deliver finished groups to the orchestrator (`Orchestrator.group_finished`)
and take their requests from its dispatcher; the learner loop talks to them
only through `Rollouts`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Protocol

import jax

from arl_jax.core import spec_codec
from arl_jax.distributed import fleet as fleet_lib
from arl_jax.envs import env_api
from arl_jax.metrics import progress as progress_lib
from arl_jax.orchestrator import env_runner as env_runner_lib
from arl_jax.orchestrator import open_work
from arl_jax.sampler import engine as engine_lib
from arl_jax.training import agent_rollouts, run_context


class Rollouts(Protocol):
  """What the learner loop may ask of the rollout side of a run."""

  def restore(self, groups: list[open_work.RestoredGroup]) -> None:
    """Takes back a checkpoint's groups still being generated (before `start`)."""

  def start(self) -> None:
    """Starts generating."""

  def cancel(self, group_ids) -> None:
    """Stops the given groups wherever they are (thread-safe)."""

  def paused(self) -> contextlib.AbstractContextManager:
    """Holds generation still for the `with` block (a checkpoint's instant)."""

  def open_segments(self) -> dict:
    """`{(group_id, sample_index): (tokens, logprobs, versions)}` of the
    segments being sampled (only inside `paused`)."""

  def metrics(self) -> dict:
    """Sampler and environment numbers for the step records (cumulative)."""

  def state_dict(self) -> dict:
    """Counters a checkpoint carries: `{"sampler": ..., "env": ...}`."""

  def load_state_dict(self, state: dict) -> None:
    """Continues the counters of a `state_dict` (before `start`)."""

  def raise_if_failed(self) -> None:
    """Raises the failure of a sampler or env worker, if one failed."""

  @property
  def failed(self) -> bool:
    """Whether something failed (see `raise_if_failed`)."""

  def stop(self) -> None:
    """Stops generating and releases threads and sockets (errors are left to
    `raise_if_failed`)."""


class LocalRollouts:
  """This process's sampler engine and env runner (plus, in a multi-controller
  run, the fleet of the other processes' samplers)."""

  def __init__(self, engine, env_runner, fleet=None):
    self._engine = engine
    self._env_runner = env_runner
    self._fleet = fleet

  @property
  def fleet(self):
    """The fleet the other processes' samplers join (None: a single process)."""
    return self._fleet

  def restore(self, groups: list[open_work.RestoredGroup]) -> None:
    self._engine.restore([e for g in groups for e in g.to_sample])
    self._env_runner.restore([r for g in groups for r in g.scored],
                             [e for g in groups for e in g.to_env])

  def start(self) -> None:
    self._engine.start()

  def cancel(self, group_ids) -> None:
    group_ids = list(group_ids)
    self._engine.cancel(group_ids)
    self._env_runner.cancel(group_ids)
    if self._fleet is not None:
      self._fleet.cancel(group_ids)

  def paused(self) -> contextlib.AbstractContextManager:
    return self._engine.paused()

  def open_segments(self) -> dict:
    return self._engine.open_segments()

  def metrics(self) -> dict:
    metrics = {**self._engine.metrics(), **self._env_runner.metrics()}
    if self._fleet is not None:
      metrics.update(self._fleet.metrics())
    return metrics

  def state_dict(self) -> dict:
    return {"sampler": self._engine.state_dict(), "env": self._env_runner.state_dict()}

  def load_state_dict(self, state: dict) -> None:
    self._engine.load_state_dict(state["sampler"])
    self._env_runner.load_state_dict(state["env"])

  def raise_if_failed(self) -> None:
    self._engine.raise_if_failed()
    self._env_runner.raise_if_failed()
    if self._fleet is not None:
      self._fleet.raise_if_failed()

  @property
  def failed(self) -> bool:
    return (self._engine.failed or self._env_runner.failed
            or (self._fleet is not None and self._fleet.failed))

  def stop(self) -> None:
    self._engine.stop(raise_errors=False)
    if self._fleet is not None:
      self._fleet.stop(raise_errors=False)
    self._env_runner.close()


class RemoteRollouts:
  """Sampler processes (`fleet.remote`): the fleet is the whole rollout side."""

  def __init__(self, fleet):
    self._fleet = fleet

  @property
  def fleet(self):
    return self._fleet

  def restore(self, groups: list[open_work.RestoredGroup]) -> None:
    # The tokens of a remote group live in its sampler process, which the
    # learner's checkpoint does not hold: unfinished groups start again.
    self._fleet.restart([g.group_id for g in groups if g.complete is None])

  def start(self) -> None:
    self._fleet.start()

  def cancel(self, group_ids) -> None:
    self._fleet.cancel(group_ids)

  def paused(self) -> contextlib.AbstractContextManager:
    # Remote groups are all at their `sample` restart point; the dispatcher's
    # lock alone makes the snapshot one instant.
    return contextlib.nullcontext()

  def open_segments(self) -> dict:
    return {}

  def metrics(self) -> dict:
    return {**self._fleet.sampler_metrics(), **self._fleet.metrics()}

  def state_dict(self) -> dict:
    return self._fleet.state_dict()

  def load_state_dict(self, state: dict) -> None:
    self._fleet.load_state_dict(state)

  def raise_if_failed(self) -> None:
    self._fleet.raise_if_failed()

  @property
  def failed(self) -> bool:
    return self._fleet.failed

  def stop(self) -> None:
    self._fleet.stop(raise_errors=False)


def build(run: run_context.RunContext, *, orchestrator, publisher,
          multi_controller: bool, tap=None) -> Rollouts:
  """The rollout side a run's config asks for (not started).

  Args:
    run: the run (its spec, meshes, graphdef, inputs; `fleet.json` goes to
      its workdir, the fleet's join/loss events to its writer).
    orchestrator: where finished groups go and requests come from.
    publisher: the `WeightPublisher` the sampler reads versions from.
    multi_controller: this is process 0 of a multi-controller run (the
      other processes' samplers join its fleet).
    tap: the engine's `schedule_tap.EngineTap` (recording or replaying a
      schedule), or None.
  """
  spec, meshes, print_fn = run.spec, run.meshes, run.print_fn
  if tap is not None and (spec.fleet.remote or multi_controller):
    raise ValueError("replay: a schedule holds one process's sampler engine only")
  fleet = None
  if spec.fleet.remote or multi_controller:
    fleet = fleet_lib.SamplerFleet(
        spec.fleet, orchestrator=orchestrator, publisher=publisher,
        spec=spec_codec.to_json(spec),
        sampler_mesh_shape=meshes.sampler.shape.items(), workdir=run.workdir, print_fn=print_fn,
        event_fn=lambda event: run.writer.write({"phase": "fleet", **event}),
        num_processes=jax.process_count())
    fleet.start()  # (before the first publish: other processes join it first)
  if spec.fleet.remote:
    return RemoteRollouts(fleet)
  if spec.agent.enabled:
    if fleet is not None:
      raise ValueError("agent.function: agents need one process (a multi-controller run's other "
                       "samplers cannot reach this process's gateway)")
    return agent_rollouts.build(run, orchestrator=orchestrator, publisher=publisher)
  tokenizer, env = run.inputs.tokenizer, run.inputs.env
  env_runner = env_runner_lib.EnvRunner(
      env, on_group_fn=orchestrator.group_finished, max_new_tokens=spec.engine.max_new_tokens,
      num_workers=spec.num_env_workers, timeout_s=spec.env_timeout_s,
      vocab_size=spec.model.vocab_size, on_scored_fn=orchestrator.rollout_scored)

  # Each handover records the episode's restart point first, should a
  # checkpoint come: once handed over, the episode belongs to the other side.
  def on_segment(episode) -> None:
    orchestrator.segment_ended(episode)
    env_runner.submit(episode)

  def on_resume(episode) -> None:
    orchestrator.episode_resumed(episode)
    engine.resume(episode)

  engine = engine_lib.SamplerEngine(
      cfg=spec.engine, settings=spec.sampling, graphdef=run.graphdef,
      model_cfg=spec.sampler_model,
      mesh=meshes.sampler, publisher=publisher, dispatcher=orchestrator.dispatcher,
      on_segment_fn=on_segment,
      stop_ids_fn=functools.partial(env_api.segment_stop_ids, tokenizer, env),
      compile_progress_fn=progress_lib.CompileProgress(
          print_fn=print_fn, bar=progress_lib.wants_bar(print_fn)),
      tap=tap)
  engine.declare_memory(run.memory.ledger)
  env_runner.connect(on_resume)
  return LocalRollouts(engine, env_runner, fleet)
