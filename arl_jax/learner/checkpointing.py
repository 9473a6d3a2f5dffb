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

A resume takes the newest *intact* checkpoint (`restore_latest_intact`): a
step whose files are damaged (a truncated array file, a missing
`_METADATA`, an unreadable run record: a disk that filled up, a copy cut
short) is skipped, and the caller is told which step and why; orbax keeps
`keep` steps, so the previous one is usually there. Temporary folders of
saves that never finished are removed when the folder is opened.

The run record (`LearnerLoop._run_record`, `training/learner_loop.py`) holds
the rest of the run: the prompt stream's position (the grain iterator's state
and the count of prompts drawn), every group in flight or in the buffer with
each rollout at its restart point (tokens, behaviour log-probs and versions sampled so far, open
segments included: `orchestrator/open_work.py`), the drop ledger and the
counters. A resume continues that work where it stopped, so no prompt is
lost or trained twice and no sampled token is thrown away.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import jax
import orbax.checkpoint as ocp

# 3: counters per component, the positions of the run's records and its config;
# 2: open work with restart points (still read: `training.start` upgrades it);
# 1: prompts only.
FORMAT_VERSION = 3
_STILL_READ = (2,)


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
  save_final: bool = True
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


class DamagedCheckpoint(ValueError):
  """One checkpoint step cannot be read (a missing or truncated file)."""


@dataclasses.dataclass(frozen=True)
class Restored:
  """What `restore_latest_intact` found.

  Attributes:
    step: the step restored.
    state: the TrainState, laid out as asked.
    run: its run record.
    reference: the KL penalty's reference params (None: not asked, or none saved).
    skipped: `(step, why)` of each newer step that could not be read.
  """

  step: int
  state: object
  run: dict
  reference: object | None
  skipped: tuple[tuple[int, str], ...]


class Checkpointer:
  """Saves and restores `(TrainState, run record)` under one folder."""

  def __init__(self, directory: str, cfg: CheckpointConfig):
    self.directory = os.path.abspath(directory)
    self._cfg = cfg
    self._closed = False
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True,
                                             enable_async_checkpointing=True,
                                             # Saves cut short by a kill.
                                             cleanup_tmp_directories=True),
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
    except Exception as e:  # noqa: BLE001 - tensorstore raises plain Exceptions for bad files
      raise DamagedCheckpoint(f"{self.directory}/{step}/state cannot be restored: "
                              f"{_short(e)}") from e
    return restored["state"]["params"]

  def _check_format(self, step: int) -> dict:
    run = self.read_run(step)
    if run.get("format_version") not in (FORMAT_VERSION, *_STILL_READ):
      raise CheckpointFormatError(
          f"{self.directory} step {step}: checkpoint format {run.get('format_version')!r}, this "
          f"code reads format {FORMAT_VERSION}")
    return run

  def read_run(self, step: int) -> dict:
    """The run record of checkpoint `step`.

    Raises:
      DamagedCheckpoint: naming the file, if it is missing or not a JSON object.
    """
    path = os.path.join(self.directory, str(step), "run")
    try:
      run = self._manager.restore(step, args=ocp.args.Composite(
          run=ocp.args.JsonRestore()))["run"]
    except (OSError, ValueError) as e:  # a missing file; JSONDecodeError is a ValueError
      raise DamagedCheckpoint(f"{path}: the run record cannot be read ({e})") from e
    if not isinstance(run, dict):
      raise DamagedCheckpoint(f"{path}: the run record is not a JSON object")
    return run

  def restore_latest_intact(self, abstract_state, *, abstract_reference=None,
                            check_run_fn=None) -> Restored:
    """The newest checkpoint that reads completely, newer damaged ones skipped.

    Args:
      abstract_state: the restore target (`abstract_like`).
      abstract_reference: the KL reference params' target, if the run has one.
      check_run_fn: run record -> the record to use (upgraded to this code's
        format), raising KeyError, TypeError or ValueError (naming the
        problem) if it lacks what the caller needs.

    Raises:
      CheckpointFormatError: another format version, or no step restores
        because none matches this run's model (every step's reason listed).
      FileNotFoundError: the folder holds no checkpoint.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    skipped = []
    for step in steps:
      try:
        run = self._check_format(step)
        if check_run_fn is not None:
          try:
            run = check_run_fn(run)
          except (KeyError, TypeError, ValueError) as e:
            raise DamagedCheckpoint(f"{self.directory}/{step}/run: {e}") from e
        metadata = os.path.join(self.directory, str(step), "state", "_METADATA")
        if not os.path.isfile(metadata):
          raise DamagedCheckpoint(f"{metadata} is missing (a save cut short or a damaged copy)")
        state = self._restore_item(step, "state", abstract_state)
        reference = None
        if abstract_reference is not None and run.get("has_reference"):
          reference = self._restore_item(step, "reference", abstract_reference)
      except DamagedCheckpoint as e:
        skipped.append((step, str(e)))
        continue
      return Restored(step=step, state=state, run=run, reference=reference,
                      skipped=tuple(skipped))
    reasons = "; ".join(f"step {step}: {why}" for step, why in skipped)
    raise CheckpointFormatError(
        f"no checkpoint in {self.directory} can be restored (when every step fails alike, they "
        f"were written for another model or optimizer): {reasons}")

  def _restore_item(self, step: int, item: str, abstract):
    try:
      return self._manager.restore(step, args=ocp.args.Composite(
          **{item: ocp.args.StandardRestore(abstract)}))[item]
    except Exception as e:  # noqa: BLE001 - tensorstore raises plain Exceptions for bad files
      raise DamagedCheckpoint(f"{self.directory}/{step}/{item} cannot be restored: "
                              f"{_short(e)}") from e

  def set_aside(self, steps) -> str | None:
    """Moves the given steps' folders out of the way, into
    `<folder>_skipped/` (kept for inspection; a later save may reuse their
    step numbers). Returns where they went (None: nothing moved)."""
    steps = [s for s in steps if os.path.isdir(os.path.join(self.directory, str(s)))]
    if not steps:
      return None
    aside = f"{self.directory}_skipped"
    os.makedirs(aside, exist_ok=True)
    for step in steps:
      shutil.move(os.path.join(self.directory, str(step)),
                  os.path.join(aside, f"{step}.{time.strftime('%Y%m%d-%H%M%S')}"))
    self._manager.reload()
    return aside

  def release(self, state) -> float:
    """Waits, where it must, until the pending save lets go of `state`'s
    buffers, before an update that donates them; returns the seconds waited.

    On a CPU backend device memory is host memory, so orbax's copy to host
    is a view of the very buffers (`np.asarray`, no copy), held until the
    write ends; an update donating them then cannot, and silently allocates
    a second state beside them, while the write's own buffers come on top
    (SmolLM2's first update after a checkpoint peaked 1.2-1.7 GiB above its
    neighbours; its 1.5 GiB state takes ~6.5 s to write on a 2-core
    machine, the wait this costs). On an accelerator the save call copies to
    host memory itself, so the write goes on beside training."""
    leaves = jax.tree.leaves(state)
    if (not leaves or not self._manager.is_saving_in_progress()
        or any(d.platform != "cpu" for d in leaves[0].sharding.device_set)):
      return 0.0
    start = time.monotonic()
    self._manager.wait_until_finished()
    return time.monotonic() - start

  def wait(self) -> None:
    """Blocks until the pending asynchronous save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    if self._closed:
      return
    self._manager.wait_until_finished()
    self._manager.close()
    self._closed = True


def _short(error: BaseException, limit: int = 400) -> str:
  """`Type: message` on one line, cut at `limit` characters (tensorstore's
  messages carry whole specs)."""
  message = " ".join(str(error).split())
  if len(message) > limit:
    message = message[:limit] + " ..."
  return f"{type(error).__name__}: {message}"


def abstract_like(state, shardings):
  """ShapeDtypeStructs of `state` placed as `shardings` say (the restore target)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)
