"""Learner checkpoints: orbax `CheckpointManager` (tensorstore-backed) for the
TrainState, and a JSON run record beside it.

Each checkpoint step holds the items `state` (params, optimizer state and
step, saved sharded by `StandardSave`, asynchronously: the learner goes on
while tensorstore writes), `run` (JSON: the format version, the policy
version, the run record below) and, with a KL penalty, `reference` (its
reference params). Orbax writes each step to a temporary folder and renames
it when complete, so a crash mid-save leaves the previous checkpoint usable.
No pickle anywhere: arrays through tensorstore, the rest as JSON.

Restoring takes the abstract state of the run being resumed (shapes, dtypes
and *its* shardings), so a checkpoint written on one learner mesh restores
onto another (for example 4 learner devices to 2).

The run record (`run_lib._run_record`) holds the rest of the run: the prompt
stream's position (the grain iterator's state and the count of prompts
drawn), every group in flight or in the buffer with each rollout at its
restart point (tokens, behaviour log-probs and versions sampled so far, open
segments included: `orchestrator/open_work.py`), the drop ledger and the
counters. A resume continues that work where it stopped, so no prompt is
lost or trained twice and no sampled token is thrown away.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import orbax.checkpoint as ocp

FORMAT_VERSION = 2  # 2: open work with restart points (1: prompts only)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
  """The `checkpoint` config section.

  Attributes:
    every_steps: save after every N updates (0: never; the final state is
      still saved when `save_final` is set).
    keep: checkpoints kept (older ones are deleted).
    save_final: save after the last update and on SIGTERM / Ctrl-C.
    resume_from: a checkpoint folder to resume when the workdir has none
      (the whole run: learner state, open work, counters).
    init_from: a checkpoint folder whose latest params start the run when
      there is nothing to resume: policy version 0, a fresh optimizer, a new
      prompt stream (for example another run's `<workdir>/checkpoints`).
  """

  every_steps: int = 0
  keep: int = 3
  save_final: bool = False
  resume_from: str = ""
  init_from: str = ""

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
    run = self._check_format(step)
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
    except ValueError as e:  # shapes or tree structure differ: another model
      raise CheckpointFormatError(f"{self.directory} step {step}: does not match this run's "
                                  f"model or optimizer: {e}") from e
    return restored["state"], run

  def restore_params(self, abstract_params, step: int | None = None):
    """Only the params of checkpoint `step` (default: the latest), laid out as
    `abstract_params` says: what `init_from` starts a run from."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    self._check_format(step)
    item = {"params": abstract_params}
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), item)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=item, restore_args=restore_args, partial_restore=True)))
    except ValueError as e:  # shapes or tree structure differ: another model
      raise CheckpointFormatError(f"{self.directory} step {step}: its params do not match this "
                                  f"run's model: {e}") from e
    return restored["state"]["params"]

  def _check_format(self, step: int) -> dict:
    run = self._manager.restore(step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
    if run.get("format_version") != FORMAT_VERSION:
      raise CheckpointFormatError(
          f"{self.directory} step {step}: checkpoint format {run.get('format_version')!r}, this "
          f"code reads format {FORMAT_VERSION}")
    return run

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
