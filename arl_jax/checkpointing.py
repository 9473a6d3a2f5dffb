"""Learner checkpoints: orbax `CheckpointManager` (tensorstore-backed) for the
TrainState, and a JSON run record beside it.

Each checkpoint step holds two items: `state` (params, optimizer state and
step, saved sharded by `StandardSave`, asynchronously: the learner goes on
while tensorstore writes) and `run` (JSON: the format version, the policy
version, counters). Orbax writes each step to a temporary folder and renames
it when complete, so a crash mid-save leaves the previous checkpoint usable.
No pickle anywhere: arrays through tensorstore, the rest as JSON.

Restoring takes the abstract state of the run being resumed (shapes, dtypes
and *its* shardings), so a checkpoint written on one learner mesh restores
onto another (for example 4 learner devices to 2).

The run record also holds the prompt stream's position (the grain iterator's
state, and the count of prompts drawn) and the prompt
of every group started but not yet trained or dropped (in flight or in the
buffer; `Dispatcher.pending_work`). A resume dispatches those again first,
then reads on, so no prompt is lost or trained twice. What is not saved yet
(the checkpoints issue): the partial rollouts themselves (tokens, log-probs,
versions) and environment episode state, so that work is regenerated rather
than continued from its prefix.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import orbax.checkpoint as ocp

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
  """The `checkpoint` config section.

  Attributes:
    every_steps: save after every N updates (0: never; the final state is
      still saved when `save_final` is set).
    keep: checkpoints kept (older ones are deleted).
    save_final: save after the last update and on SIGTERM / Ctrl-C.
    resume_from: a checkpoint folder to start from when the workdir has none.
  """

  every_steps: int = 0
  keep: int = 3
  save_final: bool = False
  resume_from: str = ""

  def __post_init__(self):
    if self.every_steps < 0:
      raise ValueError(f"checkpoint.every_steps must be >= 0, got {self.every_steps}")
    if self.keep < 1:
      raise ValueError(f"checkpoint.keep must be >= 1, got {self.keep}")

  @property
  def enabled(self) -> bool:
    return self.every_steps > 0 or self.save_final


class CheckpointFormatError(ValueError):
  """A checkpoint this code cannot read (another format version or model)."""


class Checkpointer:
  """Saves and restores `(TrainState, run record)` under one folder."""

  def __init__(self, directory: str, cfg: CheckpointConfig):
    self.directory = os.path.abspath(directory)
    self._cfg = cfg
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True,
                                             enable_async_checkpointing=True),
        item_names=("state", "run", "reference"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def should_save(self, step: int) -> bool:
    return self._cfg.every_steps > 0 and step % self._cfg.every_steps == 0

  def save(self, step: int, state, run: dict, reference=None) -> None:
    """Starts an asynchronous save of `state` and `run` as checkpoint `step`,
    with the KL penalty's reference params when there are any."""
    record = {"format_version": FORMAT_VERSION, **run, "has_reference": reference is not None}
    items = {"state": ocp.args.StandardSave(state), "run": ocp.args.JsonSave(record)}
    if reference is not None:
      items["reference"] = ocp.args.StandardSave(reference)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore_reference(self, step: int, abstract_params):
    """The reference params saved with checkpoint `step` (None if it has none)."""
    run = self._manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
    if not run.get("has_reference"):
      return None
    return self._manager.restore(step, args=ocp.args.Composite(
        reference=ocp.args.StandardRestore(abstract_params)))["reference"]

  def restore(self, abstract_state, step: int | None = None):
    """`(state, run record)` of checkpoint `step` (default: the latest), laid
    out as `abstract_state` says (its shardings decide the mesh)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    run = self._manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
    if run.get("format_version") != FORMAT_VERSION:
      raise CheckpointFormatError(
          f"{self.directory} step {step}: checkpoint format {run.get('format_version')!r}, this "
          f"code reads format {FORMAT_VERSION}")
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
    except ValueError as e:  # shapes or tree structure differ: another model
      raise CheckpointFormatError(f"{self.directory} step {step}: does not match this run's "
                                  f"model or optimizer: {e}") from e
    return restored["state"], run

  def wait(self) -> None:
    """Blocks until the pending asynchronous save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(state, shardings):
  """ShapeDtypeStructs of `state` placed as `shardings` say (the restore target)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)
