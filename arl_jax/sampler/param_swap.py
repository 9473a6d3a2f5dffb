"""Checks that newly published params can replace the live ones mid-generation.

The decode step is compiled for one tree structure, shape, dtype and sharding
of params; anything else would recompile at best and decode garbage at worst,
so a mismatch is an error naming the first offending parameter.
"""

from __future__ import annotations

import jax


def check_swap_compatible(current, new) -> None:
  """Raises ValueError unless `new` has the structure, shapes, dtypes and shardings of `current`."""
  cur_def, new_def = jax.tree.structure(current), jax.tree.structure(new)
  if cur_def != new_def:
    raise ValueError(f"published params have a different tree structure:\n{new_def}\n"
                     f"live params:\n{cur_def}")
  cur_leaves = jax.tree_util.tree_leaves_with_path(current)
  for (path, cur), new_leaf in zip(cur_leaves, jax.tree.leaves(new)):
    name = jax.tree_util.keystr(path)
    if cur.shape != new_leaf.shape or cur.dtype != new_leaf.dtype:
      raise ValueError(f"published param {name} is {new_leaf.dtype}{list(new_leaf.shape)}, "
                       f"live one is {cur.dtype}{list(cur.shape)}")
    if cur.sharding != new_leaf.sharding:
      raise ValueError(f"published param {name} has sharding {new_leaf.sharding}, live one "
                       f"has {cur.sharding}")
