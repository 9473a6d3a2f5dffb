"""Weight publishing from the learner mesh to the sampler mesh, device to device."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from arl_jax.learner import publish as publish_lib
from arl_jax.sampler import param_swap
from arl_jax.testing import tiny


@contextlib.contextmanager
def no_host_staging():
  """Forbids every host<->device transfer, explicit ones included.

  Plain `jax.transfer_guard("disallow")` lets an explicit `jax.device_put`
  stage through host memory unnoticed (checked in jax 0.10.2): the guard must
  be `disallow_explicit` on both host directions.
  """
  with jax.transfer_guard_host_to_device("disallow_explicit"), \
       jax.transfer_guard_device_to_host("disallow_explicit"):
    yield


def _setup():
  meshes = tiny.role_meshes()
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(
      tiny.tiny_model_config(), meshes)
  return meshes, params, sampler_shardings


def test_publish_never_stages_through_host_memory():
  meshes, params, sampler_shardings = _setup()
  assert not meshes.colocated
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  with no_host_staging():
    publisher.publish(params, 1)
    version, published = publisher.latest()
    jax.block_until_ready(published)
  assert version == 1
  sampler_devices = set(meshes.sampler.devices.flat)
  for leaf, want in zip(jax.tree.leaves(published), jax.tree.leaves(sampler_shardings)):
    assert leaf.sharding == want
    assert set(leaf.sharding.device_set) == sampler_devices
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(published)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_guard_catches_a_move_that_stages_through_host():
  """Negative control: without the reshard step the same move is refused."""
  meshes, params, _ = _setup()
  fsdp_sharded = params["embed"][...]
  assert fsdp_sharded.sharding.spec == P(None, "fsdp")
  with pytest.raises(Exception, match="Disallowed"):
    with no_host_staging():
      jax.device_put(fsdp_sharded, NamedSharding(meshes.sampler, P())).block_until_ready()


def test_published_params_survive_the_learner_donating_its_buffers():
  meshes, params, sampler_shardings = _setup()
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  publisher.publish(params, 0)
  for leaf in jax.tree.leaves(params):
    leaf.delete()
  _, published = publisher.latest()
  assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(published))


def test_colocated_publish_copies_too():
  meshes = tiny.role_meshes("colocated")
  _, params, sampler_shardings = tiny.learner_and_sampler_params(tiny.tiny_model_config(),
                                                                 meshes)
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  publisher.publish(params, 0)
  jax.tree.map(lambda x: x.delete(), params)
  _, published = publisher.latest()
  assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(published))


def test_versions_must_increase():
  meshes, params, sampler_shardings = _setup()
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  publisher.publish(params, 3)
  with pytest.raises(ValueError, match="not newer"):
    publisher.publish(params, 3)


def test_swap_check_names_the_mismatching_parameter():
  meshes, params, sampler_shardings = _setup()
  _, wider, _ = tiny.learner_and_sampler_params(tiny.tiny_model_config(mlp_dim=128), meshes)
  with pytest.raises(ValueError, match=r"\['mlp'\]\['down'\].*float32\[128, 32\], live one is float32\[64, 32\]"):
    param_swap.check_swap_compatible(params, wider)
  _, deeper, _ = tiny.learner_and_sampler_params(tiny.tiny_model_config(num_layers=3), meshes)
  with pytest.raises(ValueError, match="tree structure"):
    param_swap.check_swap_compatible(params, deeper)
  param_swap.check_swap_compatible(params, tiny.perturb(params, 0.1, 0))


def test_publish_with_a_dtype_casts_on_the_learner_side_without_host_staging():
  meshes, params, sampler_shardings = _setup()
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings, dtype=jnp.bfloat16)
  with no_host_staging():
    publisher.publish(params, 0)
    jax.block_until_ready(publisher.latest()[1])
  _, published = publisher.latest()
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(published)):
    assert b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))
