"""What the phases of one run share, built once by `run_lib.run`.

A run has phases (warm-up, the rollout side, the learner loop, or a
multi-controller follower) that all read the same run-wide things: the spec,
the meshes, the inputs, the record writers, the stop request. They take a
`RunContext` and a `Learner` and read what they need, instead of each taking
the same twenty arguments and handing them on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from arl_jax.models import lora as lora_lib

if TYPE_CHECKING:  # (annotations only: the phases import this module)
  from arl_jax.config.inputs import Inputs
  from arl_jax.learner.publish import WeightPublisher
  from arl_jax.learner.train_state import TrainState
  from arl_jax.metrics.memory_log import MemoryLog
  from arl_jax.metrics.startup import StartupClock
  from arl_jax.metrics.writer import JsonlWriter
  from arl_jax.sharding.mesh_lib import RoleMeshes
  from arl_jax.training.eval_log import EvalLog
  from arl_jax.training.start import Checkpoints
  from arl_jax.training.stop import StopRequest


@dataclasses.dataclass(frozen=True)
class RunContext:
  """The run-wide things every phase reads (none is replaced during a run).

  Attributes:
    spec: the resolved `run_spec.RunSpec`.
    config: the run's config as a plain dict (checkpoints carry it).
    meshes: the role meshes (`mesh_lib.RoleMeshes`).
    inputs: tokenizer, environment and prompts (`training/inputs.Inputs`).
    graphdef: the decoder's graph definition.
    workdir: the run's folder (`fleet.json`, `task_drops.json`).
    checkpoints: where the run saves and resumes (`start.Checkpoints`).
    eval_log: the run's `EvalLog`.
    writer: the metric writer (`metrics.jsonl`, ...).
    audit: the `groups.jsonl` writer (what happened to every group).
    stop: the run's `StopRequest`.
    clock: the `startup.StartupClock` (startup phases, host memory peaks).
    memory: the run's `memory_log.MemoryLog` (`memory.jsonl`; its ledger
      is where components declare what they hold).
    print_fn: where progress lines go.
    keep_batches: keep a summary of every trained batch (tests).
    schedule: the `schedule.Log` a run with `replay.record` writes
      (`schedule.jsonl`), or None.
  """

  spec: Any  # run_spec.RunSpec (config_lib imports training: no import back)
  config: dict
  meshes: RoleMeshes
  inputs: Inputs
  graphdef: Any
  workdir: str
  checkpoints: Checkpoints
  eval_log: EvalLog
  writer: Any  # (a writer_lib writer: write, lines, close)
  audit: JsonlWriter
  stop: StopRequest
  clock: StartupClock
  memory: MemoryLog
  print_fn: Callable[[str], None]
  keep_batches: bool = False
  schedule: Any = None

  @property
  def pad_id(self) -> int:
    """The tokenizer's padding id."""
    return self.inputs.tokenizer.pad_id

  @property
  def checkpointer(self):
    """Where to save (None: nowhere)."""
    return self.checkpoints.saver


@dataclasses.dataclass
class Learner:
  """The learner, ready to train from `version`.

  Attributes:
    state: the TrainState (donated to each update: always read it from
      here); its params are what trains: the whole model, or a LoRA run's
      adapters (`models/lora.py`).
    update_fn: the jitted update (`update.make_update_fn`).
    publisher: the `WeightPublisher` that ships each version to the sampler.
    reference: the KL penalty's reference params (laid out like the state's
      params, saved with it), or None.
    version: the version `state` holds, advanced by each update.
    frozen: the params that never train (a LoRA run's base; empty without
      adapters), on the learner mesh.
    base: what identifies a LoRA run's base (`start.base_identity`: saved
      with every checkpoint), or None.
  """

  state: TrainState
  update_fn: Callable
  publisher: WeightPublisher
  reference: Any
  version: int
  frozen: Any
  base: dict | None = None

  @property
  def params(self):
    """The whole model at the current version (what evaluation reads)."""
    return lora_lib.merge(self.state.params, self.frozen)
