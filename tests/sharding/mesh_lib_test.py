"""Role meshes from data."""

import jax
import pytest

from arl_jax.sharding import mesh_lib


def test_default_split_is_four_learner_four_sampler():
  meshes = mesh_lib.make_role_meshes(mesh_lib.MeshConfig())
  assert dict(meshes.learner.shape) == {"fsdp": 4, "tp": 1}
  assert dict(meshes.sampler.shape) == {"data": 4, "tp": 1}
  assert not set(meshes.learner.devices.flat) & set(meshes.sampler.devices.flat)
  assert not meshes.colocated


def test_colocated_shares_all_devices():
  meshes = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(
      placement="colocated", learner=(("fsdp", -1), ("tp", 2)), sampler=(("data", 2), ("tp", -1))))
  assert meshes.colocated
  assert dict(meshes.learner.shape) == {"fsdp": 4, "tp": 2}
  assert dict(meshes.sampler.shape) == {"data": 2, "tp": 4}


def test_single_device_falls_back_to_colocated():
  meshes = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(), devices=jax.devices()[:1])
  assert meshes.colocated


def test_uneven_split_and_errors():
  meshes = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(learner_devices=6))
  assert meshes.learner.size == 6 and meshes.sampler.size == 2
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    mesh_lib.resolve_shape((("a", -1), ("b", -1)), 4, "learner")
  with pytest.raises(ValueError, match="do not divide"):
    mesh_lib.resolve_shape((("a", 3), ("b", -1)), 4, "sampler")
  with pytest.raises(ValueError, match="duplicate axis names"):
    mesh_lib.resolve_shape((("a", 2), ("a", 2)), 4, "learner")


def test_explicit_learner_devices_are_honoured_or_rejected():
  one = jax.devices()[:1]
  with pytest.raises(ValueError, match=r"mesh.learner_devices=4 asks for 4 learner device\(s\) "
                                       r"per process .* only 1 device\(s\) are present"):
    mesh_lib.split_devices(mesh_lib.MeshConfig(learner_devices=4), one)
  with pytest.raises(ValueError, match=r"mesh.learner_devices must be -1 .* got 0"):
    mesh_lib.split_devices(mesh_lib.MeshConfig(learner_devices=0), jax.devices())
  # Automatic (-1) on one device, and an explicit colocated placement (what a
  # sampler process runs with), still share the devices.
  assert mesh_lib.split_devices(mesh_lib.MeshConfig(), one) == (one, one)
  assert mesh_lib.split_devices(
      mesh_lib.MeshConfig(placement="colocated", learner_devices=4), one) == (one, one)
  learner, sampler = mesh_lib.split_devices(mesh_lib.MeshConfig(learner_devices=4), range(5))
  assert (learner, sampler) == ([0, 1, 2, 3], [4])
