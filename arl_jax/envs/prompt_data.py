"""Prompt streams through grain: shuffled, repeated, checkpointable.

The iterator's order depends only on the seed, so the asynchronous pipeline and
the synchronous reference (`examples/minimal_grpo.py`) see the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain


def prompt_dataset(prompts: Sequence, seed: int) -> grain.MapDataset:
  """An endless, per-epoch reshuffled dataset over `prompts`."""
  if not prompts:
    raise ValueError("the prompt source is empty")
  return grain.MapDataset.source(list(prompts)).shuffle(seed=seed).repeat()


def prompt_iterator(prompts: Sequence, seed: int) -> grain.DatasetIterator:
  """A checkpointable iterator (`get_state` / `set_state`) over `prompt_dataset`."""
  return iter(prompt_dataset(prompts, seed).to_iter_dataset())
