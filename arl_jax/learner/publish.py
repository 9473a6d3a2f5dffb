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
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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


class WeightPublisher:
  """Holds the newest published `(version, sampler params)`; thread-safe."""

  def __init__(self, learner_mesh: Mesh, sampler_shardings, dtype=None):
    """Args:
      learner_mesh: the mesh the learner params live on.
      sampler_shardings: State of NamedShardings on the sampler mesh (the
        sampler rule table applied to the model).
      dtype: optional dtype the sampler runs in (e.g. bfloat16); the cast runs
        on the learner devices, before the transfer, so fewer bytes move.
    """
    sampler_mesh = jax.tree.leaves(sampler_shardings)[0].mesh
    _check_axes_match(sampler_shardings, learner_mesh, sampler_mesh)
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
    self._cond = threading.Condition()
    self._version: int | None = None
    self._params = None

  def publish(self, params, version: int) -> None:
    """Makes `params` (on the learner mesh) live for sampling as `version`."""
    with self._cond:
      if self._version is not None and version <= self._version:
        raise ValueError(f"published version {version} is not newer than {self._version}")
    bridged = self._reshard(params)
    if self._gather:  # this process's replica (the first of its learner devices)
      bridged = jax.tree.map(lambda x: x.addressable_shards[0].data, bridged)
    sampler_params = jax.device_put(bridged, self._sampler_shardings)
    with self._cond:
      self._version, self._params = version, sampler_params
      self._cond.notify_all()

  def latest(self):
    """`(version, params)` of the newest publish, or `(None, None)`."""
    with self._cond:
      return self._version, self._params
