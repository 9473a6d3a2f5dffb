"""Prompt streams through grain: sharded per host, shuffled per epoch with a
seed, repeated, checkpointable.

The order depends only on the seed (and the shard), so the asynchronous
pipeline and the synchronous reference (`examples/minimal_grpo.py`) see the
same prompts, and `get_state` / `set_state` of the iterator resume a stream
exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import jax


def prompt_dataset(prompts: Sequence, seed: int, *, shard_index: int = 0, shard_count: int = 1,
                   num_epochs: int | None = None) -> grain.MapDataset:
  """This shard's prompts, reshuffled every epoch.

  Args:
    prompts: the prompt records (all hosts pass the same list).
    seed: shuffle seed (the same on every host).
    shard_index, shard_count: this host's slice, records `shard_index::shard_count`,
      so hosts see disjoint prompts.
    num_epochs: passes over the shard (None: endless).
  """
  if not prompts:
    raise ValueError("the prompt source is empty")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index {shard_index} is not in [0, {shard_count})")
  if shard_count > len(prompts):
    raise ValueError(f"{len(prompts)} prompts cannot be split over {shard_count} hosts")
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs must be >= 1 or None, got {num_epochs}")
  dataset = grain.MapDataset.source(list(prompts))[shard_index::shard_count]
  # shuffle().repeat() draws a new permutation for every epoch.
  return dataset.shuffle(seed=seed).repeat(num_epochs)


def mixed_iterator(prompts_by_env: dict[str, Sequence], weights: dict[str, float], seed: int,
                   *, shard_index: int | None = None,
                   shard_count: int | None = None) -> grain.DatasetIterator:
  """An endless, checkpointable stream drawing from each environment's prompts
  in proportion to `weights` (each environment's prompts reshuffled per epoch)."""
  names = sorted(weights)
  missing = [n for n in names if not prompts_by_env.get(n)]
  if missing:
    raise ValueError(f"no prompts for environment(s) {missing}")
  datasets = [prompt_dataset(
      prompts_by_env[n], seed + i,
      shard_index=jax.process_index() if shard_index is None else shard_index,
      shard_count=jax.process_count() if shard_count is None else shard_count)
      for i, n in enumerate(names)]
  mixed = grain.MapDataset.mix(datasets, [weights[n] for n in names])
  return iter(mixed.to_iter_dataset())


def prompt_iterator(prompts: Sequence, seed: int, *, num_epochs: int | None = None,
                    shard_index: int | None = None,
                    shard_count: int | None = None) -> grain.DatasetIterator:
  """A checkpointable iterator over this host's shard (`jax.process_index()` of
  `jax.process_count()` unless given)."""
  dataset = prompt_dataset(
      prompts, seed,
      shard_index=jax.process_index() if shard_index is None else shard_index,
      shard_count=jax.process_count() if shard_count is None else shard_count,
      num_epochs=num_epochs)
  return iter(dataset.to_iter_dataset())
