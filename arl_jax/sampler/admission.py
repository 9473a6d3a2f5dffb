"""Which groups the engine takes, which waiting rows an admission prefills,
which start from another row's prefill, and which wait.

Rows are admitted in queue order into the free slots while their KV room
fits (`kv_slots`: a paged pool may be short of pages; the row that does not
fit and every row behind it wait, at the front of the queue). Rows with the
same context and nothing sampled of their segment yet, the samples of a
group, share one prefill (`EngineConfig.share_prompts`): the first is
inserted, the others start from it (`sampling.fork`; a paged cache shares
the prompt's pages) and sample their first token in the next decode step.
"""

from __future__ import annotations

import collections
import dataclasses

from arl_jax.core import episode as episode_lib
from arl_jax.sampler import engine_config, kv_slots, prefill_budget, sources, waiting_rows


def take_groups(requests: sources.RequestSource, cfg: engine_config.EngineConfig, *, free: int,
                version: int, timeout: float) -> list[waiting_rows.Row]:
  """The rows of the whole groups that `free` slots (beyond the rows waiting
  already) have room for, taken from `requests` (waiting up to `timeout`
  seconds for one) and checked against the engine's sizes."""
  max_groups = max(free, 0) // cfg.group_size
  if max_groups == 0:
    return []
  rows = []
  for req in requests.take(max_groups, version, timeout=timeout):
    cfg.check_request(req)
    rows += [waiting_rows.Row(episode=episode_lib.Episode(request=req, sample_index=s),
                              ready_time=req.dispatch_time) for s in range(req.group_size)]
  return rows


@dataclasses.dataclass(frozen=True)
class Admission:
  """Attributes:
    inserts: context bucket -> `(slot, row)` to prefill in that bucket.
    forks: `(slot, source slot, row)` to start from the prefill of the
      source slot's row (one of `inserts`).
    waiting: rows that did not fit, in queue order.
  """

  inserts: dict[int, list[tuple[int, waiting_rows.Row]]]
  forks: list[tuple[int, int, int, waiting_rows.Row]]
  waiting: list[waiting_rows.Row]

  @property
  def rows(self) -> list[waiting_rows.Row]:
    """Every admitted row, inserted or forked."""
    return ([row for items in self.inserts.values() for _, row in items]
            + [row for *_, row in self.forks])


def plan(free_slots: list[int], rows: list[waiting_rows.Row], cfg: engine_config.EngineConfig,
         kv: kv_slots.DenseSlots, budget: prefill_budget.PrefillBudget) -> Admission:
  """Places `rows` (popped from the front of the queue, at most one per free
  slot) in `free_slots`, taking their KV room from `kv` and their prefill
  tokens from `budget` (a fork takes none) as it goes."""
  inserts = collections.defaultdict(list)
  forks = []
  prefilled: dict[tuple[int, ...], int] = {}  # a shareable context -> the slot prefilling it
  for i, (slot, row) in enumerate(zip(free_slots, rows)):
    context = tuple(row.episode.context_ids())
    bucket = cfg.bucket_for(len(context))
    shareable = cfg.share_prompts and not row.episode.open_tokens
    source = prefilled.get(context) if shareable else None
    # (a chunked prefill computes its first chunk now: that is its cost)
    cost = cfg.chunk_columns if cfg.chunked(len(context)) else len(context)
    if source is None and not budget.fits(cost):
      return Admission(dict(inserts), forks, rows[i:])
    if not (kv.admit(slot, len(context)) if source is None
            else kv.admit_fork(slot, source, len(context))):
      return Admission(dict(inserts), forks, rows[i:])
    if source is None:
      budget.take(cost)
    if source is not None:
      forks.append((slot, source, row))
      continue
    inserts[bucket].append((slot, row))
    if shareable:
      prefilled[context] = slot
  return Admission(dict(inserts), forks, [])
