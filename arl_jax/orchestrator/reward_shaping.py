"""A soft overlong penalty (DAPO, Yu et al., 2025, "overlong reward shaping"):
completions that run into the last `overlong_buffer` tokens of the budget
lose reward in proportion to how far in they went.

With budget `L` (the prompt's own completion budget: the environment's for
that prompt, `Environment.max_new_tokens_for`, capped by
`sampler.max_new_tokens`), buffer `B` (`orchestrator.overlong_buffer`, at
most `L`) and factor `c` (`orchestrator.overlong_penalty`), a completion of
`n` tokens gets

  reward + c * min(0, (L - B - n) / B)

0 up to `L - B` tokens, falling linearly to `-c` at the budget (a truncated
completion reaches it). A prompt whose budget is below the configured buffer
is penalised over its whole budget (`B = L`), not below `-c`. Applied once,
to every rollout of a group as it reaches the orchestrator, as a shaped copy:
the rollouts the open work keeps for checkpoints keep the environment's
rewards, so the finished groups a resume restores are shaped once, like any
other. Dynamic sampling and the advantages see the shaped rewards; so the
batch reward in `metrics.jsonl` is the shaped one, while held-out evaluation
scores the environment's reward alone.
"""

from __future__ import annotations

import dataclasses

from arl_jax.core import rollout as rollout_lib


def penalty(completion_length: int, budget: int, buffer: int, factor: float) -> float:
  """`factor * min(0, (budget - buffer - n) / buffer)` with `buffer` at most
  `budget` (0 when `buffer` is 0)."""
  if buffer <= 0:
    return 0.0
  buffer = min(buffer, budget)
  return factor * min(0.0, (budget - buffer - completion_length) / buffer)


def shape(group: rollout_lib.Group, budget: int, buffer: int,
          factor: float) -> rollout_lib.Group:
  """`group` with each rollout's overlong penalty added to its reward (a copy;
  `group` itself when the penalty is off)."""
  if buffer <= 0:
    return group
  return dataclasses.replace(group, rollouts=[
      dataclasses.replace(r, reward=float(r.reward) + penalty(r.completion_length, budget,
                                                              buffer, factor))
      for r in group.rollouts])
