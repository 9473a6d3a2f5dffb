"""`Generator`: prompts in; tokens, log-probs and versions out, synchronously.

The sampler engine's scheduler (`scheduler.py`) and runner (`runner.py`)
without its thread and its sources: one call admits the prompts' groups as
slots free up, prefills and decodes them with one version of params, and
returns when every segment has ended. Evaluation (`evaluation.py`) and the
tests that sample outside a run use it, so they sample exactly as the engine
does: the same admission, shared prompts, chunked prefill, paged cache and
draws (each segment's key from the seed, group id, sample index and turn).

Multi-turn: `on_segment(episode)` sees each ended segment; when it appends
an observation (`Episode.add_observation`) and returns True, the episode is
re-admitted with its whole context, as the engine re-admits a resumed one.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from arl_jax.core import episode as episode_lib
from arl_jax.core import group_request as group_request_lib
from arl_jax.sampler import (
  engine_config,
  insert_batch,
  runner,
  sampling,
  scheduler,
  slot_fns,
  weight_updates,
)


@dataclasses.dataclass(frozen=True)
class Completion:
  """One sample's completion: every token after the prompt (observations of a
  multi-turn episode included, with version -1 and log-prob 0), the
  behaviour log-prob and version of each, and whether the last segment ended
  on a stop token."""

  tokens: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  stopped: bool


class _Prompts:
  """A `sources.RequestSource` over a fixed list of groups, taken in order."""

  def __init__(self, requests):
    self._requests = list(requests)

  def take(self, max_groups: int, live_version: int, timeout: float) -> list:
    del live_version, timeout
    taken, self._requests = self._requests[:max_groups], self._requests[max_groups:]
    return taken

  def note_sampling(self, group_id: int, version: int) -> None:
    del group_id, version

  def __bool__(self) -> bool:
    return bool(self._requests)


class Generator:
  """Samples with the engine's slot functions, compiled once for many calls.

  Args:
    cfg: the engine settings (slots, group size, buckets, cache, bursts...).
    settings: the sampling settings (greedy or tempered, stop tokens).
    graphdef: the decoder graph definition.
    model_cfg: the decoder's ModelConfig.
    mesh: where the slots live (the sampler mesh, or the learner's for evaluation).
    stop_ids_fn: prompt record -> the stop tokens (of `settings.stop_ids`)
      that end its segments; None: all of them.
  """

  def __init__(self, *, cfg: engine_config.EngineConfig, settings: sampling.SamplingSettings,
               graphdef, model_cfg, mesh: Mesh,
               stop_ids_fn: Callable[[object], tuple[int, ...]] | None = None):
    cfg.check_resolved()
    self.cfg = cfg
    fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=model_cfg, mesh=mesh,
                                    settings=settings, num_slots=cfg.num_slots,
                                    length=cfg.length, num_pages=cfg.pool_pages,
                                    page_size=cfg.page_size, paged_attention=cfg.paged_attention)
    self.runner = runner.Runner(
        cfg, fns, base_key=np.asarray(jax.random.PRNGKey(cfg.seed)), pad_id=settings.pad_id,
        stop_mask_fn=functools.partial(insert_batch.request_stop_mask, settings, stop_ids_fn))
    self.stats = None  # the last call's `engine_stats.EngineStats`

  def episodes(self, params, prompts: Sequence[Sequence[int]], *, version: int = 0,
               records: Sequence | None = None, budgets: Sequence[int | None] | None = None,
               on_segment: Callable[[episode_lib.Episode], bool] | None = None
               ) -> list[list[episode_lib.Episode]]:
    """Samples `cfg.group_size` episodes of each prompt (token ids) with
    `params` as `version`; returns them by prompt, in sample order.

    Args:
      records: each prompt's record (what `stop_ids_fn` reads), default the index.
      budgets: each prompt's completion budget (None: `cfg.max_new_tokens`).
      on_segment: called with each episode whose segment ended; True: it
        appended an observation and the episode samples its next segment.
    """
    n = len(prompts)
    records = list(range(n)) if records is None else list(records)
    budgets = [None] * n if budgets is None else list(budgets)
    now = time.monotonic()
    requests = [group_request_lib.GroupRequest(
        group_id=i, prompt=records[i], prompt_ids=tuple(int(t) for t in prompts[i]),
        dispatch_version=version, group_size=self.cfg.group_size, dispatch_time=now,
        max_new_tokens=budgets[i]) for i in range(n)]
    for request in requests:  # (before anything runs: a bad prompt is named first)
      self.cfg.check_request(request)
    source = _Prompts(requests)
    sched = scheduler.Scheduler(self.cfg, source, weight_updates.make_policy("in_flight"))
    self.stats = sched.stats
    if self.runner.state is None:
      self.runner.init()
    sched.publish(version, params)
    sched.went_live(version, 0.0)
    ended: dict[tuple[int, int], episode_lib.Episode] = {}
    while source or not sched.idle:
      for episode in sched.iterate(self.runner):
        if on_segment is not None and on_segment(episode):
          if not self.cfg.multi_turn:
            raise ValueError("on_segment continued an episode: that needs an engine "
                             "configured with multi_turn=True")
          sched.resume(episode)
        else:
          ended[(episode.group_id, episode.sample_index)] = episode
    return [[ended[(i, s)] for s in range(self.cfg.group_size)] for i in range(n)]

  def release(self) -> None:
    """Frees the slots' state (their KV cache) until the next call, so that a
    generator kept between uses (the held-out evaluation's) holds nothing
    meanwhile; the next call allocates it again (a compiled program: ms)."""
    self.runner.state = None

  def __call__(self, params, prompts: Sequence[Sequence[int]], **kwargs
               ) -> list[list[Completion]]:
    """`episodes`' completions (same arguments)."""
    return [[Completion(tokens=np.array(e.completion_ids, np.int32),
                        logprobs=np.array(e.logprobs, np.float32),
                        versions=np.array(e.versions, np.int32), stopped=e.last_stopped)
             for e in group] for group in self.episodes(params, prompts, **kwargs)]
