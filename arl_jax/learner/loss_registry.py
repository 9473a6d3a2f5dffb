"""Every policy loss, by name: the `ENTRIES` of each module of
`learner/objectives/` (`loss_entry.LossEntry`), found when this module is
imported, so a loss added there needs no other edit: its name is valid for
`learner.loss`, its knobs are keys of the `learner` section
(`config/schema.py` reads `KNOBS`), and the update calls it.
"""

from __future__ import annotations

import importlib
import pkgutil

from arl_jax.learner import loss_entry, objectives


def _collect() -> dict[str, loss_entry.LossEntry]:
  found = {}
  # (every folder of the package's path: a test appends one with a loss of its own)
  for module in sorted(m.name for m in pkgutil.iter_modules(objectives.__path__)):
    entries = getattr(importlib.import_module(f"{objectives.__name__}.{module}"), "ENTRIES", {})
    for name, entry in entries.items():
      if name in found:
        raise ValueError(f"loss {name!r} is registered twice (objectives/{module}.py)")
      if not isinstance(entry, loss_entry.LossEntry):
        raise TypeError(f"objectives/{module}.py: ENTRIES[{name!r}] is not a LossEntry")
      found[name] = entry
  return found


LOSSES: dict[str, loss_entry.LossEntry] = _collect()
# The losses' knob classes, each once (their fields are `learner` keys).
KNOBS: tuple[type, ...] = tuple(dict.fromkeys(e.knobs for e in LOSSES.values() if e.knobs))
