"""The experiment configs that ship with arl_jax, found the same way everywhere.

They live in the repository's top-level `configs/`; `arl_jax/configs` links to
that folder and is package data, so an editable checkout and an installed
wheel both hold them at `<package>/configs/NAME.py`.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

# (`arl_jax/configs`: beside this package)
FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def names() -> list[str]:
  """The built-in configs (`arith`, `tool_agent`, ...)."""
  return sorted(f[:-3] for f in os.listdir(FOLDER) if f.endswith(".py") and f[0] != "_")


def path(name: str) -> str:
  """`configs/<name>.py` of the package.

  Raises:
    FileNotFoundError: naming the configs there.
  """
  found = os.path.join(FOLDER, f"{name}.py")
  if not os.path.isfile(found):
    raise FileNotFoundError(f"no built-in config {name!r}; built-in: {names()}")
  return found


def load(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """An unlocked copy of `get_config(arg)` of built-in config `name`
  (`configs/<name>.py`), or of the config file at path `name` (ending in
  `.py`: relative to the working directory).

  Raises:
    FileNotFoundError: naming the path, or the built-in configs.
  """
  if name.endswith(".py"):
    if not os.path.isfile(name):
      raise FileNotFoundError(f"no config file {name!r} (from {os.getcwd()}); built-in "
                              f"configs by name: {names()}")
    return _load_file(name, os.path.splitext(os.path.basename(name))[0], arg)
  return _load_file(path(name), name, arg)


def _load_file(file: str, name: str, arg: str | None) -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location(f"arl_jax_configs_{name}", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return ml_collections.ConfigDict(module.get_config(arg).to_dict())
