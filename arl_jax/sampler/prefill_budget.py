"""`PrefillBudget`: the prompt tokens one engine iteration may prefill
(`EngineConfig.max_prefill_tokens`), as vLLM's `max_num_batched_tokens`
bounds a step's prefill.

A prefill delays the decode step of every other live slot by its cost, so
the budget bounds the stall a burst of admissions or long contexts puts
between two tokens of the rows already decoding. The scheduler spends it
first on the chunks of prefills under way (their rows hold slots and pages
already), then on admissions in queue order: a whole insert costs its
context's tokens, a chunked prefill's chunk its columns (the device
computes them all), a fork nothing (it copies a prefill). Admission stops
at the first row that does not fit (first come, first served: no row jumps
the queue); a prefill under way that does not fit waits for the next
iteration. The first item of an iteration always fits, so a context longer
than the budget is still prefilled (with `prefill_chunk` set, a chunk at a
time); without a budget (0) everything is prefilled at once, as before.
"""

from __future__ import annotations

import math


class PrefillBudget:
  """Tokens left to prefill in one iteration, and `spent` so far."""

  def __init__(self, limit: int):
    self.left = limit if limit > 0 else math.inf
    self.spent = 0

  def fits(self, tokens: int) -> bool:
    """Whether `tokens` fit what is left, or nothing was spent yet (progress)."""
    return tokens <= self.left or not self.spent

  def take(self, tokens: int) -> None:
    self.left -= tokens
    self.spent += tokens
