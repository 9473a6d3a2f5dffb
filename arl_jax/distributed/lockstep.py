"""Multi-controller lockstep: process 0 decides, every process executes.

In a multi-controller run every process must call the same jitted programs in
the same order with the same shapes (docs/design.md section 8). The decisions that
change them (which rollouts train, the batch's width, when the run stops,
whether a final checkpoint is saved) are made once, by process 0's
orchestrator, and broadcast before each step: a small header first, then the
step's `ShardPlan` (kilobytes: which rollouts train where, `shard_plan.py`).
The batch itself never passes through here: each process fills its own
rows from the groups it sampled (`shard_batch.py`).

The broadcast is a sum over the learner devices only (gloo on CPU), not over
every device as `multihost_utils.broadcast_one_to_all` is: a collective
queued on the sampler devices would hold this process's sampler engine behind
it until process 0 joins, and process 0 waits for that engine's rollouts to
cut the batch (a deadlock).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arl_jax.distributed import shard_plan as shard_plan_lib

BATCH, STOP = 0, 1
_HEADER = ("kind", "evaluate", "save", "rollouts", "forget", "complete")


@dataclasses.dataclass(frozen=True)
class Step:
  """What every process does next: train on the batch `plan` lays out
  (`BATCH`), or stop (`STOP`); then evaluate and save a checkpoint when the
  flags say so. Process 0 decides; the others only execute (`training/follower.py`).
  A `STOP` says whether the run is complete (every process exits with the
  same status: `arl_jax/launch.py`)."""

  kind: int
  plan: shard_plan_lib.ShardPlan | None = None
  evaluate: bool = False
  save: bool = False
  complete: bool = False


def is_multi_controller() -> bool:
  return jax.process_count() > 1


def is_leader() -> bool:
  return jax.process_index() == 0


def process_rows(mesh: Mesh) -> Mesh:
  """`mesh`'s devices as a `(processes, local)` mesh (every process the same
  number of devices, in process order)."""
  count = jax.process_count()
  by_process = np.array(mesh.devices.flatten()).reshape(count, -1)
  if any(d.process_index != p for p, row in enumerate(by_process) for d in row):
    raise ValueError("the mesh must hold the same number of devices of every process, in "
                     "process order")
  return Mesh(by_process, ("processes", "local"))


def broadcast(tree, mesh: Mesh):
  """Process 0's numpy arrays `tree` on every process (the others pass arrays
  of the same shapes and dtypes), through a collective over `mesh`'s devices
  (the learner mesh: one or more devices of every process)."""
  rows = process_rows(mesh)
  count = jax.process_count()
  leader = is_leader()

  def one(x):
    x = np.asarray(x)
    local = (x if leader else np.zeros_like(x))[None]
    return jax.make_array_from_process_local_data(NamedSharding(rows, P("processes")), local,
                                                  (count, *x.shape))

  summed = _sum_rows(rows)(jax.tree.map(one, tree))
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), summed)


def all_gather(data: bytes, size: int, mesh: Mesh) -> np.ndarray:
  """`[processes, size]` uint8: row p holds process p's `data` (at most
  `size` bytes, zero-padded), on every process; each receives the others'
  rows only (an all-gather over `mesh`'s devices)."""
  rows = process_rows(mesh)
  local = np.zeros((1, size), np.uint8)
  local[0, :len(data)] = np.frombuffer(data, np.uint8)
  gathered = _replicate(rows)(jax.make_array_from_process_local_data(
      NamedSharding(rows, P("processes")), local, (jax.process_count(), size)))
  return np.asarray(gathered.addressable_data(0))


@functools.cache
def _replicate(mesh: Mesh):
  return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))


@functools.cache
def _sum_rows(mesh: Mesh):
  return jax.jit(lambda tree: jax.tree.map(lambda x: x.sum(0, dtype=x.dtype), tree),
                 out_shardings=NamedSharding(mesh, P()))


def leader_broadcast_fn(fleet, mesh: Mesh):
  """Process 0's `(step_index, Step) -> None`: announces collective
  `step_index` to the other processes over the fleet's sockets, then shares
  `Step` over the learner `mesh` (the announcement first: see the module
  docstring of `training/follower.py`)."""

  def broadcast(index: int, step: Step) -> None:
    fleet.announce(index)
    share(step, mesh)

  return broadcast


def share(step: Step | None, mesh: Mesh) -> Step:
  """Process 0 passes its `Step`, the others None; every process gets it.
  `mesh`: the learner mesh (see `broadcast`)."""
  leader = step is not None
  header = np.zeros(len(_HEADER), np.int32)
  if leader:
    plan = step.plan
    header[:] = [step.kind, step.evaluate, step.save,
                 0 if plan is None else len(plan.group_ids),
                 0 if plan is None else len(plan.forget), step.complete]
  header = dict(zip(_HEADER, (int(x) for x in broadcast(header, mesh))))
  flags = {"evaluate": bool(header["evaluate"]), "save": bool(header["save"])}
  if header["kind"] != BATCH:
    return Step(kind=header["kind"], complete=bool(header["complete"]), **flags)
  if leader:
    arrays = step.plan.to_arrays()
  else:  # the same shapes and dtypes as the leader's
    arrays = shard_plan_lib.ShardPlan.empty_arrays(header["rollouts"], header["forget"])
  plan = shard_plan_lib.ShardPlan.from_arrays(broadcast(arrays, mesh))
  return Step(kind=BATCH, plan=plan, **flags)


def share_text(text: str | None, mesh: Mesh, size: int = 512) -> str:
  """Process 0's `text` (e.g. an address) on every process."""
  buffer = np.zeros(size, np.uint8)
  if text is not None:
    data = text.encode()
    if len(data) > size:
      raise ValueError(f"{len(data)} bytes do not fit the {size}-byte broadcast")
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
  received = broadcast(buffer, mesh)
  return received.tobytes().rstrip(b"\0").decode()
