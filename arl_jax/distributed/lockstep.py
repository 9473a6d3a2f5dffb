"""Multi-controller lockstep: process 0 decides, every process executes.

In a multi-controller run every process must call the same jitted programs in
the same order with the same shapes (docs/design.md section 8). The decisions that
change them (which rollouts train, the batch's width, when the run stops,
whether a final checkpoint is saved) are made once, by process 0's
orchestrator, and broadcast before each step: a small header first, then the
batch arrays in the shape it names.

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

from arl_jax import train_batch as train_batch_lib

BATCH, STOP = 0, 1
_HEADER = ("kind", "rows", "columns", "evaluate", "save")


@dataclasses.dataclass(frozen=True)
class Step:
  """What every process does next: train on `batch` (`BATCH`), or stop
  (`STOP`); then evaluate and save a checkpoint when the flags say so.
  Process 0 decides; the others only execute (`follower.py`)."""

  kind: int
  batch: train_batch_lib.TrainBatch | None = None
  evaluate: bool = False
  save: bool = False


def is_multi_controller() -> bool:
  return jax.process_count() > 1


def is_leader() -> bool:
  return jax.process_index() == 0


def broadcast(tree, mesh: Mesh):
  """Process 0's numpy arrays `tree` on every process (the others pass arrays
  of the same shapes and dtypes), through a collective over `mesh`'s devices
  (the learner mesh: one or more devices of every process)."""
  devices = mesh.devices.flatten()
  count = jax.process_count()
  by_process = np.array(devices).reshape(count, -1)
  if any(d.process_index != p for p, row in enumerate(by_process) for d in row):
    raise ValueError("the mesh must hold the same number of devices of every process, in "
                     "process order")
  rows = Mesh(by_process, ("processes", "local"))
  leader = is_leader()

  def one(x):
    x = np.asarray(x)
    local = (x if leader else np.zeros_like(x))[None]
    return jax.make_array_from_process_local_data(NamedSharding(rows, P("processes")), local,
                                                  (count, *x.shape))

  summed = _sum_rows(rows)(jax.tree.map(one, tree))
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), summed)


@functools.cache
def _sum_rows(mesh: Mesh):
  return jax.jit(lambda tree: jax.tree.map(lambda x: x.sum(0, dtype=x.dtype), tree),
                 out_shardings=NamedSharding(mesh, P()))


def leader_broadcast_fn(fleet, mesh: Mesh):
  """Process 0's `(step_index, Step) -> None`: announces collective
  `step_index` to the other processes over the fleet's sockets, then shares
  `Step` over the learner `mesh` (the announcement first: see the module
  docstring of `follower.py`)."""

  def broadcast(index: int, step: Step) -> None:
    fleet.announce(index)
    share(step, mesh)

  return broadcast


def share(step: Step | None, mesh: Mesh) -> Step:
  """Process 0 passes its `Step`, the others None; every process gets it.
  `mesh`: the learner mesh (see `broadcast`)."""
  leader = step is not None
  if leader:
    rows, columns = (step.batch.tokens.shape if step.batch is not None else (0, 0))
    header = np.array([step.kind, rows, columns, step.evaluate, step.save], np.int32)
  else:
    header = np.zeros(len(_HEADER), np.int32)
  header = dict(zip(_HEADER, (int(x) for x in broadcast(header, mesh))))
  if header["kind"] != BATCH:
    return Step(kind=header["kind"], evaluate=bool(header["evaluate"]), save=bool(header["save"]))
  # The same shapes and dtypes on every process (the leader's cast to them).
  template = train_batch_lib.zeros(header["rows"], header["columns"])
  arrays = {name: getattr(template, name) for name in train_batch_lib.FIELDS}
  dtypes = {name: a.dtype for name, a in arrays.items()}
  if leader:
    arrays = {name: np.asarray(getattr(step.batch, name)).astype(dtypes[name])
              for name in train_batch_lib.FIELDS}
  # (Booleans travel as bytes: the broadcast is a sum over devices.)
  sent = {name: a.astype(np.uint8) if a.dtype == bool else a for name, a in arrays.items()}
  received = broadcast(sent, mesh)
  batch = train_batch_lib.TrainBatch(**{
      name: np.asarray(received[name]).astype(dtypes[name]) for name in train_batch_lib.FIELDS})
  return Step(kind=BATCH, batch=batch, evaluate=bool(header["evaluate"]),
              save=bool(header["save"]))


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
