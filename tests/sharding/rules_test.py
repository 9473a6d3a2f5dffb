"""Shardings of arrays named by logical axes, through a rule table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from arl_jax.sharding import rules as rules_lib

RULES = {"rows": "data", "heads": "tp", "cols": None}


def _mesh():
  return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tp"))


def test_each_array_is_placed_by_its_axis_names():
  tree = {"a": jax.ShapeDtypeStruct((4, 6), jnp.float32), "b": (jnp.zeros((4, 2, 3)),)}
  axes = {"a": ("rows", "cols"), "b": (("rows", "heads", "cols"),)}
  shardings = rules_lib.array_shardings(tree, axes, _mesh(), RULES)
  assert shardings["a"].spec == P("data", None)
  assert shardings["b"][0].spec == P("data", "tp", None)


def test_names_that_do_not_fit_the_array_are_clear_errors():
  tree = {"a": jax.ShapeDtypeStruct((4, 6), jnp.float32)}
  with pytest.raises(ValueError, match=r"array \['a'\] of shape \(4, 6\) is named by 1 logical"):
    rules_lib.array_shardings(tree, {"a": ("rows",)}, _mesh(), RULES)
  with pytest.raises(ValueError, match="no sharding rule for logical axis 'slots'"):
    rules_lib.array_shardings(tree, {"a": ("slots", "cols")}, _mesh(), RULES)
  with pytest.raises(ValueError, match=r"array \['a'\] of shape \(4, 5\): dimension 5 does not "
                                       r"divide by mesh axis 'tp' of size 2"):
    rules_lib.array_shardings({"a": jax.ShapeDtypeStruct((4, 5), jnp.float32)},
                              {"a": ("rows", "heads")}, _mesh(), RULES)
