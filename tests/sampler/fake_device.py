"""A plain-Python stand-in for the sampler's runner (`runner.Runner`): it
executes the scheduler's plans on a model of the device's slots, so that the
scheduler can be tested without JAX.

Each slot holds the segment under way (an open segment's tokens first, as
`sampling.insert` puts them), how many tokens it sampled since its
admission, its budget and its done flag. Tokens are drawn from a seeded
generator; a draw ends the segment with probability `eos_rate` or at the
budget. Every token drawn is also logged per episode (`drawn`), so a test
can check that an episode's completion holds exactly what was drawn for it,
across preemptions, in order: nothing lost and nothing sampled twice.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from arl_jax.sampler import plans, segments

EOS = 1


@dataclasses.dataclass
class _Slot:
  episode: object = None
  tokens: list = dataclasses.field(default_factory=list)  # (token, logprob, version)
  new: int = 0
  budget: int = 0
  done: bool = True
  stopped: bool = False


class FakeDevice:
  """Args:
    num_slots: B.
    max_new_tokens: the engine's default budget.
    eos_rate: chance that a draw is the stop token.
    seed: the draws' seed.
  """

  def __init__(self, num_slots: int, max_new_tokens: int, eos_rate: float = 0.1, seed: int = 0):
    self.slots = [_Slot() for _ in range(num_slots)]
    self._max_new = max_new_tokens
    self._eos_rate = eos_rate
    self._rng = np.random.default_rng(seed)
    self.drawn: dict[tuple[int, int], list[int]] = {}  # (group, sample) -> tokens drawn for it
    self.page_table = None  # the last page table sent
    self.recomputed = None  # the slots the last recompute covered

  def _put(self, slot: int, episode) -> _Slot:
    s = self.slots[slot] = _Slot(episode=episode, budget=episode.budget_left(self._max_new),
                                 done=False)
    s.tokens = list(zip(episode.open_tokens, episode.open_logprobs, episode.open_versions))
    return s

  def _draw(self, s: _Slot, version: int) -> None:
    if s.done:
      return
    token = EOS if self._rng.random() < self._eos_rate else int(self._rng.integers(2, 100))
    s.tokens.append((token, -float(token) / 100, version))
    key = (s.episode.group_id, s.episode.sample_index)
    self.drawn.setdefault(key, []).append(token)
    s.new += 1
    s.stopped = token == EOS
    s.done = s.stopped or s.new >= s.budget

  def _done(self) -> np.ndarray:
    return np.array([s.done for s in self.slots])

  # -- the runner's interface ---------------------------------------------------

  def prefill(self, plan: plans.PrefillPlan) -> np.ndarray:
    if plan.page_table is not None:
      self.page_table = plan.page_table.copy()
    for work in plan.work:
      if isinstance(work, plans.Insert):
        for slot, row in work.items:
          self._draw(self._put(slot, row.episode), work.version)
      elif isinstance(work, plans.BeginChunks):
        for slot, _, row in work.items:
          self._put(slot, row.episode)
      elif isinstance(work, plans.Fork):
        for slot, source, row in work.items:
          assert self.slots[source].episode.context_ids() == row.episode.context_ids(), (
              "a fork starts from another prompt")
          self._put(slot, row.episode)
      else:
        for slot in sorted(set(work.rows[work.final].tolist())):
          self._draw(self.slots[slot], work.version)
    return self._done()

  def decode(self, plan: plans.DecodePlan) -> tuple[np.ndarray, list[segments.Segment]]:
    preempted = self.read_segments(list(plan.preempted)) if plan.preempted else []
    if plan.page_table is not None:
      self.page_table = plan.page_table.copy()
    for i, call in enumerate(plan.calls):
      if i == 0 and plan.stop is not None:  # (the first call ends the stopped slots)
        for slot in np.flatnonzero(plan.stop):
          self.slots[slot].done = True
      if call.slots is not None:
        rows = sorted(set(call.slots.tolist()))
      else:
        rows = range(len(self.slots)) if call.mask is None else np.flatnonzero(call.mask)
      for _ in range(plan.steps):
        for slot in rows:
          self._draw(self.slots[slot], call.version)
    return self._done(), preempted

  def read_segments(self, slots: list[int]) -> list[segments.Segment]:
    read = []
    for slot in slots:
      s = self.slots[slot]
      tokens, logprobs, versions = zip(*s.tokens) if s.tokens else ((), (), ())
      read.append(segments.Segment(list(tokens), list(logprobs), list(versions), s.stopped))
    return read

  def recompute(self, plan: plans.Recompute) -> None:
    self.recomputed = plan.occupied.copy()
