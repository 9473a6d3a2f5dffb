"""Logical-axis rule tables: where each named array dimension lives per role.

A rule table maps a logical axis name (as written on the parameter, see
`models/decoder.py`, or on the sampler's slot state, see
`SlotState.logical_axes`) to a mesh axis or None (replicated). The learner
shards weights over `fsdp` and `tp`; the sampler only over `tp`, replicating
over its `data` axis so that each data shard can decode its own slots without
gathers. The sampler's slots (`batch`) go over `data`, and their KV cache's
heads over `tp`, like the attention weights that produce them.
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
    "lora_rank": None,  # (an adapter's rank: small, never split)
}

SAMPLER_RULES: Rules = {
    "vocab": "tp",
    "embed": None,
    "q_heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "norm": None,
    "lora_rank": None,
    # The slot state (`SlotState.logical_axes`).
    "batch": "data",
    "length": None,
    "stop_ids": None,
    "prng_key": None,
    "alternatives": None,
    # The paged KV cache (`PagedKVCache.logical_axes`): pages are shared by
    # every slot, so the pool is whole on each `data` shard.
    "kv_pages": None,
    "page_rows": None,
    "slot_pages": None,
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


def _check_divisible(name: str, shape, spec: P, mesh: Mesh) -> None:
  for dim, axis in zip(shape, spec):
    if axis is not None and dim % mesh.shape[axis]:
      raise ValueError(f"{name} of shape {shape}: dimension {dim} does not divide by mesh axis "
                       f"{axis!r} of size {mesh.shape[axis]}")


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
    _check_divisible(f"parameter {jax.tree_util.keystr(path)}", variable.get_value().shape,
                     spec, mesh)
    return variable.replace(NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(sharding_of, abstract_state, is_leaf=_is_variable)


def array_shardings(abstract_tree, logical_axes, mesh: Mesh, rules: Rules):
  """NamedSharding per array of a pytree whose arrays carry no metadata.

  Args:
    abstract_tree: a pytree of arrays (or `jax.ShapeDtypeStruct`s).
    logical_axes: the same pytree with, in place of each array, the tuple of
      its dimensions' logical axis names (e.g. `SlotState.logical_axes()`).
    mesh: the mesh to place the arrays on.
    rules: the logical-axis rule table.

  Returns:
    The structure of `abstract_tree` with a NamedSharding per array.

  Raises:
    ValueError: when an array's axis names do not match its rank, a name has
      no rule, or a sharded dimension does not divide by its mesh axis.
  """

  def sharding_of(path, leaf, axes):
    name = f"array {jax.tree_util.keystr(path)}"
    if len(axes) != len(leaf.shape):
      raise ValueError(f"{name} of shape {leaf.shape} is named by {len(axes)} logical axes "
                       f"{axes}")
    spec = logical_to_spec(axes, rules, mesh)
    _check_divisible(name, leaf.shape, spec, mesh)
    return NamedSharding(mesh, spec)

  # `logical_axes` has `abstract_tree` as its prefix: each array meets its tuple whole.
  return jax.tree_util.tree_map_with_path(sharding_of, abstract_tree, logical_axes)


def specs_of(shardings):
  """The PartitionSpecs of a State of NamedShardings (same structure)."""
  return jax.tree.map(lambda s: s.spec, shardings)


def with_mesh(specs, mesh: Mesh):
  """NamedShardings on `mesh` for a tree of PartitionSpecs."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, P))
