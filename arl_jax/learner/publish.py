"""Publishing learner weights to the sampler mesh, device to device.

Two steps, both on devices: (1) reshard on the learner mesh into the sampler's
per-shard layout (same PartitionSpec, learner devices), (2) `jax.device_put`
onto the sampler mesh, which then moves identical shards between devices.
Moving arrays between disjoint device sets with a *different* per-shard layout
stages through host memory in jax 0.10 (docs/jax_notes.md); step (1) avoids that,
and `tests/learner/publish_test.py` proves it under a transfer guard.

Multi-controller runs: the learner mesh spans processes and each process
samples on its own devices, so step (1) gathers a whole replica onto every
learner device (a collective across processes, in the sampler's dtype) and
step (2) moves this process's replica to its sampler mesh.

With LoRA (`models/lora.py`) the learner trains only the adapters (and a
critic's value head beside them): the frozen base moves to the sampler mesh
once, when the publisher is built, and every publish moves what trains
alone (`published_bytes` says how many bytes a
publish moved); the sampler decodes with the resident base plus the newest
adapters, unmerged, as the learner scores. Where the learner's base already
lies as the sampler would hold it (colocated roles whose shardings agree,
in the sampler's dtype), the sampler reads those very arrays: the update
never donates the base, so one copy serves both roles (`shares_base`).
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arl_jax.models import lora as lora_lib
from arl_jax.sharding import rules as rules_lib


def _check_axes_match(sampler_shardings, learner_mesh: Mesh, sampler_mesh: Mesh) -> None:
  used = {axis for sharding in jax.tree.leaves(sampler_shardings)
          for axis in sharding.spec if axis is not None}
  for axis in sorted(used):
    if learner_mesh.shape.get(axis) != sampler_mesh.shape.get(axis):
      raise ValueError(
          f"sampler params are sharded over mesh axis {axis!r} (size "
          f"{sampler_mesh.shape.get(axis)}), but the learner mesh has it with size "
          f"{learner_mesh.shape.get(axis)}; device-to-device publish needs the same size "
          "on both meshes")


class Mover:
  """Moves a params State from the learner mesh onto its `sampler_shardings`
  (steps 1 and 2 of the module docstring), cast to `dtype` when given: a
  publish's move, and the placement of params a sampled evaluation reads."""

  def __init__(self, learner_mesh: Mesh, sampler_shardings, dtype=None):
    specs = rules_lib.specs_of(sampler_shardings)
    self._sampler_shardings = sampler_shardings
    # Several processes: a whole replica everywhere (see the module docstring).
    self._gather = not all(d.process_index == jax.process_index()
                           for d in learner_mesh.devices.flat)
    bridge_shardings = (jax.tree.map(lambda _: NamedSharding(learner_mesh, P()), specs)
                        if self._gather else rules_lib.with_mesh(specs, learner_mesh))
    # jnp.copy: publishing must never alias the learner's buffers, which the
    # next (donating) update step invalidates.
    cast = lambda x: jnp.copy(x) if dtype is None or x.dtype == dtype else x.astype(dtype)
    self._reshard = jax.jit(lambda p: jax.tree.map(cast, p), out_shardings=bridge_shardings)

  def __call__(self, params):
    bridged = self._reshard(params)
    if self._gather:  # this process's replica (the first of its learner devices)
      bridged = jax.tree.map(lambda x: x.addressable_shards[0].data, bridged)
    return jax.device_put(bridged, self._sampler_shardings)


def shares_base(frozen, base_shardings, dtype=None) -> bool:
  """Whether the learner's `frozen` base can be the sampler's as it is: every
  array already laid out as `base_shardings` say, in `dtype` (None: as is)."""
  def same(x, sharding):
    return ((dtype is None or x.dtype == dtype)
            and x.sharding.is_equivalent_to(sharding, x.ndim))
  return all(jax.tree.leaves(jax.tree.map(same, frozen, base_shardings)))


class WeightPublisher:
  """Holds the newest published `(version, sampler params)`; thread-safe."""

  def __init__(self, learner_mesh: Mesh, sampler_shardings, dtype=None, frozen=None,
               keep_versions: bool = False):
    """Args:
      learner_mesh: the mesh the learner params live on.
      sampler_shardings: State of NamedShardings on the sampler mesh (the
        sampler rule table applied to the whole model).
      dtype: optional dtype the sampler runs in (e.g. bfloat16); the cast runs
        on the learner devices, before the transfer, so fewer bytes move.
      frozen: the frozen base on the learner mesh when the model has
        adapters (`lora.split`): moved to the sampler mesh here, once (or
        read where it lies: `shares_base`);
        `publish` then takes what trains (`lora.split`'s first part). None:
        `publish` takes the
        whole model.
      keep_versions: hold every published version until `published` hands
        it out (a replay's engine takes each version at its recorded
        iteration, however far ahead the learner is).
    """
    sampler_mesh = jax.tree.leaves(sampler_shardings)[0].mesh
    _check_axes_match(sampler_shardings, learner_mesh, sampler_mesh)
    trainable, base = lora_lib.split(sampler_shardings)
    if bool(frozen is not None and jax.tree.leaves(frozen)) != bool(jax.tree.leaves(base)):
      raise ValueError("a model with adapters publishes them with its frozen base given "
                       "once (frozen=...); a model without takes no frozen base")
    self._move = Mover(learner_mesh, trainable, dtype)
    self._base = None
    self.base_shared = False  # the sampler reads the learner's base arrays themselves
    if jax.tree.leaves(base):
      self.base_shared = shares_base(frozen, base, dtype)
      self._base = frozen if self.base_shared else Mover(learner_mesh, base, dtype)(frozen)
    self._cond = threading.Condition()
    self._version: int | None = None
    self._params = None
    self._moved = None
    self._history: dict | None = {} if keep_versions else None
    self.published_bytes = 0  # what the last publish moved to the sampler mesh

  def publish(self, params, version: int) -> None:
    """Makes `params` (the trainable params on the learner mesh: the whole
    model, or its adapters) live for sampling as `version`."""
    with self._cond:
      if self._version is not None and version <= self._version:
        raise ValueError(f"published version {version} is not newer than {self._version}")
    moved = self._move(params)
    sampler_params = moved if self._base is None else lora_lib.merge(moved, self._base)
    with self._cond:
      self._version, self._params, self._moved = version, sampler_params, moved
      if self._history is not None:
        self._history[version] = sampler_params
      self.published_bytes = sum(x.nbytes for x in jax.tree.leaves(moved))
      self._cond.notify_all()

  def latest(self):
    """`(version, params)` of the newest publish, or `(None, None)`."""
    with self._cond:
      return self._version, self._params

  def published(self, version: int, timeout: float):
    """The params of `version` once published (waiting up to `timeout`
    seconds; None then), forgetting it and every older version held
    (`keep_versions`)."""
    with self._cond:
      if not self._cond.wait_for(lambda: version in self._history, timeout):
        return None
      params = self._history[version]
      self._history = {v: p for v, p in self._history.items() if v > version}
      return params

  def latest_trained(self):
    """`(version, params, trained)` of the newest publish: `trained` is the
    part a publish moves (the adapters with LoRA, else the whole params), so
    that a holder of the base needs only it (`distributed/weight_transfer.py`)."""
    with self._cond:
      return self._version, self._params, self._moved

  @property
  def frozen_base(self):
    """The frozen base on the sampler mesh, moved there once at construction
    (None: the model has no adapters and every publish moves all of it)."""
    return self._base

  @property
  def has_frozen_base(self) -> bool:
    """Whether the params are a resident base plus published adapters."""
    return self._base is not None
