"""Role meshes declared as data: `[(axis, size), ...]` with -1 for "the rest".

Devices are split between a `learner` and a `sampler` role. Disaggregated
(disjoint device sets) is the default when there are at least two devices;
colocated (both roles on the same devices, time-sliced) otherwise or on request.

Multi-controller runs (`jax.distributed`, several processes): each process
splits its own devices the same way; the learner mesh spans the learner
devices of every process (one SPMD program), and each process has its own
sampler mesh on its local sampler devices (each host samples on its own,
docs/design.md section 8). `learner_devices` then counts per process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

MeshShape = Sequence[tuple[str, int]]

PLACEMENTS = ("auto", "disaggregated", "colocated")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """How devices are split into role meshes.

  Attributes:
    placement: `auto` (disaggregated when >= 2 devices), `disaggregated` or
      `colocated`.
    learner_devices: devices given to the learner when disaggregated (per
      process); -1 (automatic) means half of them, the sampler gets the rest.
      An explicit count needs a disaggregated split: with `auto` on a single
      device it is an error, not a silent fallback to colocated.
    learner: learner mesh axes, e.g. `(("fsdp", -1), ("tp", 1))`.
    sampler: sampler mesh axes, e.g. `(("data", -1), ("tp", 1))`.
  """

  placement: str = "auto"
  learner_devices: int = -1
  learner: tuple[tuple[str, int], ...] = (("fsdp", -1), ("tp", 1))
  sampler: tuple[tuple[str, int], ...] = (("data", -1), ("tp", 1))


@dataclasses.dataclass(frozen=True)
class RoleMeshes:
  learner: Mesh
  sampler: Mesh

  @property
  def colocated(self) -> bool:
    return set(self.learner.devices.flat) == set(self.sampler.devices.flat)


def resolve_shape(shape: MeshShape, num_devices: int, role: str) -> tuple[tuple[str, int], ...]:
  """Replaces a single -1 by the size that uses all `num_devices`.

  Raises:
    ValueError: naming the role when the axes do not multiply to `num_devices`.
  """
  names = [name for name, _ in shape]
  sizes = [size for _, size in shape]
  if len(set(names)) != len(names):
    raise ValueError(f"mesh.{role}: duplicate axis names {names}")
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh.{role}: at most one axis may be -1, got {list(shape)}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh.{role}: axis sizes must be positive or -1, got {list(shape)}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
          f"mesh.{role}={list(shape)}: fixed axes ({known} devices) do not divide the "
          f"{num_devices} devices of this role")
    sizes[sizes.index(-1)] = num_devices // known
  elif known != num_devices:
    raise ValueError(
        f"mesh.{role}={list(shape)} needs {known} devices but the role has {num_devices}")
  return tuple(zip(names, sizes))


def split_devices(cfg: MeshConfig, devices: Sequence[jax.Device]) -> tuple[list, list]:
  """Returns `(learner_devices, sampler_devices)` for the configured placement."""
  devices = list(devices)
  n = len(devices)
  placement = cfg.placement
  if placement not in PLACEMENTS:
    raise ValueError(f"mesh.placement must be one of {PLACEMENTS}, got {placement!r}")
  explicit = cfg.learner_devices != -1
  if explicit and (type(cfg.learner_devices) is not int or cfg.learner_devices < 1):
    raise ValueError(f"mesh.learner_devices must be -1 (automatic: half of the devices) or an "
                     f"int >= 1, got {cfg.learner_devices!r}")
  if placement == "auto" and explicit and n < 2:
    # `auto` would fall back to colocated here and silently give the learner
    # every device (shared with the sampler), not the count asked for.
    k = cfg.learner_devices
    raise ValueError(
        f"mesh.learner_devices={k} asks for {k} learner device(s) per process plus at least "
        f"one for the sampler ({k + 1} devices), but only {n} device(s) are present; use "
        "mesh.learner_devices=-1 (automatic: on one device both roles share it)")
  if placement == "auto":
    placement = "disaggregated" if n >= 2 else "colocated"
  if placement == "colocated":
    return devices, devices
  if n < 2:
    raise ValueError(f"mesh.placement='disaggregated' needs >= 2 devices, found {n}")
  n_learner = n // 2 if cfg.learner_devices == -1 else cfg.learner_devices
  if not 1 <= n_learner < n:
    raise ValueError(
        f"mesh.learner_devices={cfg.learner_devices} must leave at least one device to "
        f"each role; {n} devices exist (per process)")
  return devices[:n_learner], devices[n_learner:]


def role_devices(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> tuple[list, list]:
  """`(learner devices, this process's sampler devices)`: `split_devices` of
  `devices`, or with None and several processes, of each process's own
  devices (the learner gets every process's share, the sampler this one's)."""
  if devices is not None or jax.process_count() == 1:
    return split_devices(cfg, jax.devices() if devices is None else devices)
  learner = []
  for process in range(jax.process_count()):
    local = [d for d in jax.devices() if d.process_index == process]
    learner += split_devices(cfg, local)[0]
  return learner, split_devices(cfg, jax.local_devices())[1]


def make_role_meshes(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> RoleMeshes:
  """Builds the learner and sampler meshes (validates before touching devices)."""
  learner_devices, sampler_devices = role_devices(cfg, devices)
  learner_shape = resolve_shape(cfg.learner, len(learner_devices), "learner")
  sampler_shape = resolve_shape(cfg.sampler, len(sampler_devices), "sampler")
  return RoleMeshes(
      learner=_mesh(learner_devices, learner_shape),
      sampler=_mesh(sampler_devices, sampler_shape),
  )


def _mesh(devices, shape) -> Mesh:
  names = tuple(name for name, _ in shape)
  sizes = tuple(size for _, size in shape)
  return Mesh(np.array(devices).reshape(sizes), names)


def reported_memory(devices: Sequence) -> int | None:
  """Bytes of memory the first of `devices` reports (None: planned devices,
  or a backend that reports none, like the CPU)."""
  stats = getattr(devices[0], "memory_stats", lambda: None)() if devices else None
  return (stats or {}).get("bytes_limit")
