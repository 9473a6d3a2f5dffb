"""Who holds the memory: live device arrays grouped by owner, beside host RSS.

A run's components say what they hold (`Ledger.hold`: an owner's name, the
object that holds it, and how to read its arrays from that object). An
accounting (`Ledger.account`) then walks every live array of the process
(`jax.live_arrays`) once and charges each buffer to the first owner that
holds it (a buffer two owners share, e.g. a colocated sampler reading the
learner's params, counts once, for the first); what no owner claims is
`unclaimed` (jitted programs' cached constants, arrays a component made and
did not declare). The ledger keeps weak references only: an owner that is
gone (an evaluation engine freed) simply holds nothing.

On a CPU backend the devices' memory is the process's memory, so the host's
resident size beside the accounting (`host_rss`) says what the arrays miss:
compiled programs' temporaries while they run (`host_memory` peaks), the
runtime, Python, host copies (a checkpoint's staging, batches).
`benchmarks/memory.py` prints the table for a config's run.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import jax

from arl_jax.metrics import host_memory

UNCLAIMED = "unclaimed"


@dataclasses.dataclass(frozen=True)
class Account:
  """Bytes per owner (every device of this process together), the busiest
  device's live bytes, and the host's resident size then (None where the
  platform does not say)."""

  by_owner: dict[str, int]
  busiest_device: int
  host_rss: int | None

  @property
  def live(self) -> int:
    return sum(self.by_owner.values())

  def record(self) -> dict:
    """`{"by_owner": {owner: bytes}, "live_bytes", "busiest_device_bytes",
    "host_rss_bytes"}` for a `memory.jsonl` row (exact: small owners matter
    in tests)."""
    return {"by_owner": dict(self.by_owner), "live_bytes": self.live,
            "busiest_device_bytes": self.busiest_device, "host_rss_bytes": self.host_rss}


def _buffers(tree) -> list[tuple[tuple[int, int], int]]:
  """`((device id, buffer address), bytes)` of every addressable shard of the
  arrays in `tree` (deleted ones, i.e. donated, hold nothing)."""
  out = []
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, jax.Array) or leaf.is_deleted():
      continue
    try:
      shards = [((shard.device.id, shard.data.unsafe_buffer_pointer()), shard.data.nbytes)
                for shard in leaf.addressable_shards]
    except (RuntimeError, TypeError):
      # Donated by another thread after the check above (a deleted array's
      # shards are gone mid-read): it holds nothing now.
      continue
    out.extend(shards)
  return out


class Ledger:
  """What each owner holds; thread-safe to read while owners change (a
  buffer donated between the walk's steps is simply skipped)."""

  def __init__(self):
    self._owners: list[tuple[str, weakref.ref, Callable[[Any], Any]]] = []

  def hold(self, owner: str, holder: Any, read: Callable[[Any], Any] = lambda h: h) -> None:
    """`owner` holds the arrays `read(holder)` returns, for as long as
    `holder` lives (a weak reference: the ledger keeps nothing alive).
    Owners are charged in the order they were declared."""
    self._owners.append((owner, weakref.ref(holder), read))

  @property
  def owners(self) -> list[str]:
    return list(dict.fromkeys(name for name, _, _ in self._owners))

  def account(self) -> Account:
    claimed: dict[tuple[int, int], str] = {}
    for name, ref, read in self._owners:
      holder = ref()
      if holder is None:
        continue
      try:
        buffers = _buffers(read(holder))
      except RuntimeError:  # (an array donated while we read it)
        continue
      for key, _ in buffers:
        claimed.setdefault(key, name)
    by_owner = collections.Counter({name: 0 for name in self.owners})
    per_device: collections.Counter = collections.Counter()
    seen = set()
    for array in jax.live_arrays():
      try:
        buffers = _buffers(array)
      except RuntimeError:
        continue
      for key, size in buffers:
        if key in seen:
          continue
        seen.add(key)
        by_owner[claimed.get(key, UNCLAIMED)] += size
        per_device[key[0]] += size
    return Account(by_owner=dict(by_owner), busiest_device=max(per_device.values(), default=0),
                   host_rss=host_memory.resident_bytes())
