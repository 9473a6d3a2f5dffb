"""`ChunkedPrefills`: the scheduler's book of the slots whose contexts are
being prefilled a chunk at a time (`EngineConfig.chunk_columns`,
`prefill_chunks.py` on the device), and of the forks waiting for them.

A context longer than a chunk is put in its slot (`begin`)
and then advanced by one chunk per engine iteration (`step` plans the
`plans.Chunk` calls; with a prefill budget, those `select` pays for),
between decode
steps of the other slots, until its last chunk samples its first token. The
other samples of its group (`share_prompts`) hold their slots meanwhile and
start from it (`sampling.fork`) once it is whole. Both kinds of slot are
`held`: no decode call, harvest or burst touches them. A held slot that
leaves (cancelled, preempted) is `drop`ped; a source that leaves hands back
the forks that were waiting on it.

Every chunk of a row runs under the params that decode it now (the live
version, or its own pinned one): under in-flight `keep` a swap in the middle
leaves the earlier chunks' keys and values as they were, as it does for a
decoding row's; `recompute` prefills them again (the slot's `index` is the
end of its prefilled columns).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import numpy as np

from arl_jax.sampler import engine_config, plans, prefill_budget

ForkItem = tuple  # (slot, source slot, waiting_rows.Row), as admission.Admission.forks


@dataclasses.dataclass
class _Prefill:
  starts: list[int]  # first column of each chunk still to run
  forks: list[ForkItem] = dataclasses.field(default_factory=list)


class ChunkedPrefills:
  """See the module docstring; plain Python, written by the scheduler only."""

  def __init__(self, cfg: engine_config.EngineConfig):
    self._cfg = cfg
    self._prefills: dict[int, _Prefill] = {}  # slot -> what is left of its prefill
    self._sources: dict[int, int] = {}  # a waiting fork's slot -> its source's slot
    self.calls = 0  # prefill_chunk calls made

  def __bool__(self) -> bool:
    return bool(self._prefills)

  @property
  def held(self) -> set[int]:
    """Slots that are prefilling or waiting for a prefill to fork from."""
    return set(self._prefills) | set(self._sources)

  def prefilling(self, slot: int) -> bool:
    return slot in self._prefills

  def awaits_source(self, slot: int) -> bool:
    """Whether `slot` holds a fork that has not started (nothing of it is on the device)."""
    return slot in self._sources

  def begin(self, items) -> list[tuple[int, int, object]]:
    """Puts `(slot, row)` in their slots for chunked prefill; returns
    `(slot, first chunk's start, row)` for the runner (`plans.BeginChunks`)."""
    begun = []
    for slot, row in items:
      starts = engine_config.chunk_starts(len(row.episode.context_ids()),
                                          self._cfg.chunk_columns)
      self._prefills[slot] = _Prefill(starts)
      begun.append((slot, starts[0], row))
    return begun

  def wait(self, fork: ForkItem) -> None:
    """Holds `fork` `(slot, source, row)` until its source is prefilled."""
    slot, source = fork[0], fork[1]
    self._prefills[source].forks.append(fork)
    self._sources[slot] = source

  def select(self, budget: prefill_budget.PrefillBudget) -> list[int]:
    """The prefilling slots whose next chunk `budget` pays for, in the order
    their prefills began (the oldest first), taken from it."""
    chosen = []
    for slot in self._prefills:
      if not budget.fits(self._cfg.chunk_columns):
        break
      budget.take(self._cfg.chunk_columns)
      chosen.append(slot)
    return chosen

  def step(self, slots: list[int], version_of: Callable[[int], int],
           params_of: Callable[[int], object]
           ) -> tuple[list[plans.Chunk], list[int], list[ForkItem]]:
    """Plans one chunk of each of the prefilling `slots`, one call per version
    (`version_of(slot)`; `params_of(version)` its params).

    Returns:
      The chunk calls, the slots whose prefill they end (their first token
      sampled), and the forks that can start from those then.
    """
    by_version = collections.defaultdict(list)
    for slot in sorted(slots):
      by_version[version_of(slot)].append(slot)
    chunks, finished, ready = [], [], []
    for version, of_version in sorted(by_version.items()):
      starts = [self._prefills[s].starts.pop(0) for s in of_version]
      final = [not self._prefills[s].starts for s in of_version]
      rows, padded_starts, padded_final = self._padded(of_version, starts, final)
      chunks.append(plans.Chunk(
          version=version, params=params_of(version), rows=rows, starts=padded_starts,
          final=padded_final,
          span=self._cfg.decode_span(max(starts) + self._cfg.chunk_columns - 1)))
      self.calls += 1
      for slot in (s for s, last in zip(of_version, final) if last):
        plan = self._prefills.pop(slot)
        finished.append(slot)
        ready += plan.forks
        for fork in plan.forks:
          del self._sources[fork[0]]
    return chunks, finished, ready

  def _padded(self, slots, starts, final) -> tuple[np.ndarray, ...]:
    """A chunk call's `rows`, `start` and `final`, padded to a row bucket by
    repeating the last row."""
    extra = engine_config.row_bucket(len(slots), self._cfg.num_slots) - len(slots)
    pad = lambda values, dtype: np.array(values + [values[-1]] * extra, dtype)
    return pad(slots, np.int32), pad(starts, np.int32), pad(final, bool)

  def drop(self, slot: int) -> list[ForkItem]:
    """Forgets `slot` (its row left); a prefilling source returns the forks
    that were waiting on it (their slots must be freed too)."""
    if slot in self._sources:
      plan = self._prefills[self._sources.pop(slot)]
      plan.forks = [fork for fork in plan.forks if fork[0] != slot]
      return []
    plan = self._prefills.pop(slot, None)
    if plan is None:
      return []
    for fork in plan.forks:
      del self._sources[fork[0]]
    return plan.forks
