"""Logical-axis rule tables: where each named parameter dimension lives per role.

A rule table maps a logical axis name (as written on the parameter, see
`models/decoder.py`) to a mesh axis or None (replicated). The learner shards
weights over `fsdp` and `tp`; the sampler only over `tp`, replicating over its
`data` axis so that each data shard can decode its own slots without gathers.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Rules = Mapping[str, str | None]

LEARNER_RULES: Rules = {
    "vocab": "tp",
    "embed": "fsdp",
    "q_heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "norm": None,
}

SAMPLER_RULES: Rules = {
    "vocab": "tp",
    "embed": None,
    "q_heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "norm": None,
}


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def logical_to_spec(logical_axes, rules: Rules, mesh: Mesh) -> P:
  """PartitionSpec for one parameter; axes absent from the mesh are replicated."""
  spec = []
  for name in logical_axes:
    if name not in rules:
      raise ValueError(f"no sharding rule for logical axis {name!r}; rules know {sorted(rules)}")
    axis = rules[name]
    spec.append(axis if axis in mesh.axis_names and mesh.shape[axis] > 1 else None)
  return P(*spec)


def state_shardings(abstract_state, mesh: Mesh, rules: Rules):
  """NamedSharding per parameter, as a State of the same structure as `abstract_state`.

  Raises:
    ValueError: when a sharded dimension does not divide by its mesh axis,
      naming the parameter, its shape and the axis.
  """

  def sharding_of(path, variable):
    axes = variable.get_metadata().get("logical_axes")
    if axes is None:
      raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no logical_axes metadata")
    spec = logical_to_spec(axes, rules, mesh)
    shape = variable.get_value().shape
    for dim, axis in zip(shape, spec):
      if axis is not None and dim % mesh.shape[axis]:
        raise ValueError(
            f"parameter {jax.tree_util.keystr(path)} of shape {shape}: dimension {dim} does "
            f"not divide by mesh axis {axis!r} of size {mesh.shape[axis]}")
    return variable.replace(NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(sharding_of, abstract_state, is_leaf=_is_variable)


def specs_of(shardings):
  """The PartitionSpecs of a State of NamedShardings (same structure)."""
  return jax.tree.map(lambda s: s.spec, shardings)


def with_mesh(specs, mesh: Mesh):
  """NamedShardings on `mesh` for a tree of PartitionSpecs."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, P))
