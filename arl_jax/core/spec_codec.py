"""Frozen settings dataclasses to JSON and back (what a sampler process receives).

A learner sends a sampler process the resolved settings it runs with (a
`run_spec.RunSpec`), not the raw config to validate and patch again: what
the learner decided (meshes, buckets, stop tokens) arrives as decided. The
encoding is plain JSON: a dataclass is its class's dotted name and its init
fields; a tuple is marked (settings are hashable jit arguments, so tuples stay
tuples). Only classes of this package are rebuilt, and rebuilding runs their
checks again.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping

_PACKAGE = "arl_jax."
_CLASS, _TUPLE = "__dataclass__", "__tuple__"


def to_json(value):
  """`value` (dataclasses, tuples, lists, str-keyed dicts, scalars) as JSON values."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    cls = type(value)
    fields = {f.name: to_json(getattr(value, f.name))
              for f in dataclasses.fields(value) if f.init}
    return {_CLASS: f"{cls.__module__}.{cls.__qualname__}", **fields}
  if isinstance(value, tuple):
    return {_TUPLE: [to_json(v) for v in value]}
  if isinstance(value, list):
    return [to_json(v) for v in value]
  if isinstance(value, Mapping):
    if not all(isinstance(k, str) for k in value):
      raise TypeError(f"only str keys encode, got {sorted(map(repr, value))}")
    return {k: to_json(v) for k, v in value.items()}
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  raise TypeError(f"cannot encode {type(value).__name__} {value!r}")


def from_json(value):
  """The inverse of `to_json`.

  Raises:
    ValueError: for a class outside this package or one that does not exist.
  """
  if isinstance(value, list):
    return [from_json(v) for v in value]
  if not isinstance(value, dict):
    return value
  if _TUPLE in value:
    return tuple(from_json(v) for v in value[_TUPLE])
  if _CLASS not in value:
    return {k: from_json(v) for k, v in value.items()}
  cls = _class(value[_CLASS])
  return cls(**{k: from_json(v) for k, v in value.items() if k != _CLASS})


def _class(name: str) -> type:
  if not name.startswith(_PACKAGE):
    raise ValueError(f"{name!r} is not a class of arl_jax")
  module_name, _, qualname = name.rpartition(".")
  try:
    cls = getattr(importlib.import_module(module_name), qualname)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"no class {name!r}") from e
  if not dataclasses.is_dataclass(cls):
    raise ValueError(f"{name!r} is not a dataclass")
  return cls
