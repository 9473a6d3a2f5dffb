"""Module paths that moved, kept importable for one release (0.1 -> 0.2).

Issue 53 gave the top level of `arl_jax/` a shape: the configuration went to
`arl_jax.config`, the data contracts every role shares to `arl_jax.core`, the
composition root (`run`, the dry run, evaluation) to `arl_jax.training`. A
user's config file or script that imports an old path (`from arl_jax import
config_base, sweep`) keeps working: the old name is the new module, with a
DeprecationWarning that names where it went. A meta-path finder serves them,
so no file stands at the old place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# Removed in the release after 0.2.
MOVED = {
    "arl_jax.settings": "arl_jax.core.settings",
    "arl_jax.spec_codec": "arl_jax.core.spec_codec",
    "arl_jax.rollout": "arl_jax.core.rollout",
    "arl_jax.episode": "arl_jax.core.episode",
    "arl_jax.rows": "arl_jax.core.rows",
    "arl_jax.train_batch": "arl_jax.core.train_batch",
    "arl_jax.advantages": "arl_jax.core.advantages",
    "arl_jax.packing": "arl_jax.core.packing",
    "arl_jax.compile_cache": "arl_jax.core.compile_cache",
    "arl_jax.trace_counter": "arl_jax.sampler.trace_counter",
    "arl_jax.config_sections": "arl_jax.config.schema",
    "arl_jax.config_base": "arl_jax.config.base_config",
    "arl_jax.config_lib": "arl_jax.config.run_spec",
    "arl_jax.config_argument": "arl_jax.config.cli_argument",
    "arl_jax.builtin_configs": "arl_jax.config.builtin",
    "arl_jax.sweep": "arl_jax.config.sweep",
    "arl_jax.training.inputs": "arl_jax.config.inputs",
    "arl_jax.checkpointing": "arl_jax.learner.checkpointing",
    "arl_jax.run_lib": "arl_jax.training.run_lib",
    "arl_jax.dry_run": "arl_jax.training.dry_run",
    "arl_jax.evaluation": "arl_jax.training.evaluation",
}


class _Alias(types.ModuleType):
  """The old name: every attribute is the new module's (reading and setting)."""

  def __init__(self, name: str, target: types.ModuleType):
    super().__init__(name, target.__doc__)
    object.__setattr__(self, "_target", target)

  def __getattr__(self, attribute):
    return getattr(object.__getattribute__(self, "_target"), attribute)

  def __setattr__(self, attribute, value):
    if attribute.startswith("__"):  # (the import system's own bookkeeping)
      object.__setattr__(self, attribute, value)
    else:
      setattr(object.__getattribute__(self, "_target"), attribute, value)

  def __dir__(self):
    return dir(object.__getattribute__(self, "_target"))


class _Loader(importlib.abc.Loader):

  def __init__(self, new: str):
    self._new = new

  def create_module(self, spec):
    warnings.warn(f"{spec.name} moved to {self._new}; import it from there (the old path "
                  "goes in the next release)", DeprecationWarning, stacklevel=3)
    return _Alias(spec.name, importlib.import_module(self._new))

  def exec_module(self, module):
    del module  # (the new module ran when it was imported)


class _Finder(importlib.abc.MetaPathFinder):

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    new = MOVED.get(fullname)
    return None if new is None else importlib.util.spec_from_loader(fullname, _Loader(new))


def install() -> None:
  """Serves the old paths (once per process)."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
