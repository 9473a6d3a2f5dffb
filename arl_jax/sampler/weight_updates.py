"""How the sampler engine moves to newly published weights (`weight_update`).

The engine checks for a new version between two decode steps and asks its
policy what to do; the policy holds the params of every version it still
needs and says which of them decode which slots:

- `in_flight`: swap to the newest params at once; active slots continue.
  KV policy `keep` leaves their cache as computed; `recompute` re-prefills it
  under the new params. Later tokens record the new version either way.
- `pinned`: every slot finishes on the version it started with; the policy
  holds each version still referenced (at most K + 1, since older groups are
  cancelled), and each version's slots decode with its own params.
- `drain`: once a newer version is published, admit nothing new, let the
  active slots finish, then swap.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable

KV_POLICIES = ("keep", "recompute")


class Swap(enum.Enum):
  """What the engine does with a newly published version."""

  DEFER = "defer"  # keep decoding on the live version; ask again at the next step
  NOW = "now"  # the new version is live; the active slots' caches stay as they are
  RECOMPUTE = "recompute"  # live, and the active slots' caches are re-prefilled under it


class WeightUpdatePolicy(abc.ABC):
  """The params the engine holds, by version, and when a new version goes live.

  The engine calls `on_publish` with each newer version it sees; unless told
  to defer, that version is live from then on. It decodes each version of
  `decode_versions` with `params(version)` on the slots started on it, and
  after every change of its slots hands `retain` the versions still in use.
  """

  def __init__(self):
    self._params: dict[int, object] = {}

  @abc.abstractmethod
  def on_publish(self, version: int, params, *, busy: bool) -> Swap:
    """A version newer than the live one was published.

    Args:
      version: its number.
      params: its params.
      busy: whether any slot is decoding.

    Returns:
      What the engine does now; unless `Swap.DEFER`, the policy holds
      `params` from here on and `version` is live.
    """

  @property
  def admission_paused(self) -> bool:
    """Whether the engine must admit nothing into free slots for now."""
    return False

  def decode_versions(self, slot_versions: Iterable[int], live: int) -> list[int]:
    """The versions to run a decode pass with, given the start version of
    every occupied slot and the live version."""
    del slot_versions
    return [live]

  def params(self, version: int):
    """The params of a held `version`."""
    return self._params[version]

  def held(self) -> dict:
    """`{version: params}` of every version held now (a copy: the memory
    ledger reads it from another thread)."""
    return dict(self._params)

  def retain(self, versions: set[int]) -> int:
    """Drops every held version not in `versions`; returns how many are held."""
    self._params = {v: p for v, p in self._params.items() if v in versions}
    return len(self._params)


class InFlight(WeightUpdatePolicy):
  """Swaps at once; `recompute` re-prefills the active slots' caches."""

  def __init__(self, recompute: bool):
    super().__init__()
    self._recompute = recompute

  def on_publish(self, version: int, params, *, busy: bool) -> Swap:
    self._params = {version: params}
    return Swap.RECOMPUTE if self._recompute and busy else Swap.NOW


class Pinned(WeightUpdatePolicy):
  """Each slot decodes with the version it started on, to the end of its segment."""

  def on_publish(self, version: int, params, *, busy: bool) -> Swap:
    del busy
    self._params[version] = params
    return Swap.NOW

  def decode_versions(self, slot_versions: Iterable[int], live: int) -> list[int]:
    del live
    # One model pass per version held by a slot (the engine counts them).
    return sorted(set(slot_versions))


class Drain(WeightUpdatePolicy):
  """Admits nothing once a newer version is out, and swaps when the slots are empty."""

  def __init__(self):
    super().__init__()
    self._waiting = False

  def on_publish(self, version: int, params, *, busy: bool) -> Swap:
    # The deferred params are not held: the engine reads the newest version
    # again at every step, so a later publish during the drain wins.
    self._waiting = busy
    if busy:
      return Swap.DEFER
    self._params = {version: params}
    return Swap.NOW

  @property
  def admission_paused(self) -> bool:
    return self._waiting


# `weight_update` name -> `(kv_policy) -> policy`; config validation reads the same keys.
POLICIES = {
    "in_flight": lambda kv_policy: InFlight(recompute=kv_policy == "recompute"),
    "pinned": lambda kv_policy: Pinned(),
    "drain": lambda kv_policy: Drain(),
}
WEIGHT_UPDATE_MODES = tuple(POLICIES)


def check_names(weight_update: str, kv_policy: str) -> None:
  """Raises ValueError unless `weight_update` is one of WEIGHT_UPDATE_MODES
  and `kv_policy` one of KV_POLICIES."""
  if weight_update not in POLICIES:
    raise ValueError(f"weight_update must be one of {WEIGHT_UPDATE_MODES}, got {weight_update!r}")
  if kv_policy not in KV_POLICIES:
    raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {kv_policy!r}")


def make_policy(weight_update: str, kv_policy: str = "keep") -> WeightUpdatePolicy:
  """A fresh policy named `weight_update`; `kv_policy` is what `in_flight`
  does with the active slots' caches (see `check_names`)."""
  check_names(weight_update, kv_policy)
  return POLICIES[weight_update](kv_policy)
