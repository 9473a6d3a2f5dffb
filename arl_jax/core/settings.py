"""How a component's settings dataclass is also a section of the config.

A setting is declared once: as a field of the frozen dataclass its component
takes (`EngineConfig`, `SamplingSettings`, ...), with its default, its
documentation (the class's `Attributes:`) and its check (`__post_init__`,
through `check`, which names the field). `schema.SECTIONS` lists the
dataclasses that make up each section of an experiment config; their fields
are the section's keys, and `config_lib` builds them from those keys without
naming any (the config's base, `base_config.py`, is made from the same
fields). Adding a setting is adding a field and using it.

A field the config does not set, because the run decides it from another
section or from what it loaded (the sampler's group size is the
orchestrator's, its stop tokens the tokenizer's), is declared with `derived`
and named in `config_lib`, the one place that wires sections together.

Plain Python: importable where JAX is not.
"""

from __future__ import annotations

import dataclasses

_DERIVED = "arl_jax_derived_from"


class SettingError(ValueError):
  """A refused setting: the message starts with the field's name (`top_p:
  must be in (0, 1], got 0.0`), which `config_lib` prefixes with the
  section (`config.sampler.top_p: ...`)."""

  def __init__(self, key: str, message: str):
    super().__init__(f"{key}: {message}")
    self.key = key
    self.message = message


def check(cond: bool, key: str, message: str) -> None:
  """Raises `SettingError(key, message)` unless `cond`."""
  if not cond:
    raise SettingError(key, message)


def is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def derived(default, source: str):
  """A field the run sets from `source` (a key of another section, or what
  it loaded: "tokenizer", "environment"), not a key of the config."""
  return dataclasses.field(default=default, metadata={_DERIVED: source})


def derived_fields(cls) -> dict[str, str]:
  """`cls`'s derived fields and where the run takes each from."""
  return {f.name: f.metadata[_DERIVED] for f in dataclasses.fields(cls)
          if f.init and _DERIVED in f.metadata}


def keys(cls) -> tuple[str, ...]:
  """The config keys `cls` declares: its init fields that are not derived."""
  return tuple(f.name for f in dataclasses.fields(cls) if f.init and _DERIVED not in f.metadata)


def required_keys(cls) -> tuple[str, ...]:
  """The keys of `cls` without a default: a config must give them."""
  return tuple(f.name for f in dataclasses.fields(cls)
               if f.init and _DERIVED not in f.metadata
               and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING)


def defaults(cls) -> dict:
  """The keys of `cls` that have defaults, with them."""
  out = {}
  for f in dataclasses.fields(cls):
    if not f.init or _DERIVED in f.metadata:
      continue
    if f.default is not dataclasses.MISSING:
      out[f.name] = f.default
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = f.default_factory()
  return out


def attribute_docs(cls) -> dict[str, str]:
  """Each field's text from the docstring `Attributes:` section (Google
  style: `name: text`, continued on lines indented deeper), one line each,
  of `cls` or of the dataclass it derives from (a subclass that changes a
  default documents what differs, not every field again)."""
  out = {}
  for klass in reversed(cls.__mro__):
    if dataclasses.is_dataclass(klass):
      out.update(_own_attribute_docs(klass))
  return out


def _own_attribute_docs(cls) -> dict[str, str]:
  doc = cls.__dict__.get("__doc__") or ""
  lines = doc.splitlines()
  start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
  if start is None:
    # A one-paragraph docstring may start with "Attributes:" on its first line.
    start = next((i for i, line in enumerate(lines) if line.strip().endswith("Attributes:")),
                 None)
  if start is None:
    return {}
  names = {f.name for f in dataclasses.fields(cls)}
  out, name, indent = {}, None, None
  for line in lines[start + 1:]:
    if not line.strip():
      continue
    depth = len(line) - len(line.lstrip())
    head, _, rest = line.strip().partition(":")
    if (indent is None or depth == indent) and head in names and rest.startswith(" "):
      name, indent = head, depth
      out[name] = rest.strip()
    elif name is not None and depth > indent:
      out[name] += " " + line.strip()
    else:
      break
  return out
