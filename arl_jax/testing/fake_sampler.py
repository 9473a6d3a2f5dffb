"""A discrete-event replay of asynchronous RL with a fake sampler and a fake clock.

It drives the real `orchestrator.Orchestrator` (dispatcher, buffer, drop
ledger) exactly as `run_lib` does, but replaces the sampler, the environments
and the learner by events on a simulated clock:

- the fake sampler takes every group admission control allows, runs up to
  `num_slots` groups at a time (the rest wait in its queue, FIFO, as requests
  wait in an inference server's queue; the built-in engine instead takes
  groups only for free slots, so there a group's first token is nearly always
  sampled at its dispatch version and the two staleness references rarely
  differ), and samples
  each group's tokens evenly over its duration, each token recording the
  version live at that instant (in-flight weight updates);
- a group's duration comes from `duration_fn(prompt)`, so completion time can
  be made to correlate with difficulty;
- the learner cuts `B_u` whenever it is idle and a batch is ready, trains for
  `train_seconds`, then publishes `u + 1` (which cancels what can no longer ship).

Everything is deterministic given the prompts and durations, so tests assert
exact properties of the control logic, and `benchmarks/orchestrator.py`
compares policies on the same event stream without a model.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterator

import numpy as np

from arl_jax import rollout as rollout_lib
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import orchestrator as orchestrator_lib


class FakeClock:
  """Simulated seconds; the orchestrator reads it like `time.monotonic`."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
  """Attributes:
    dispatch, buffer: the orchestrator's settings, as in a real run.
    num_steps: learner updates to simulate.
    train_seconds: simulated duration of one learner update.
    num_slots: groups the fake sampler generates at once (None: all admitted).
    tokens_per_second: completion length of a group is `duration * this`,
      capped at `max_new_tokens` (capped completions finish with `length`).
    max_new_tokens: the completion budget.
    mask_truncated_completions: as the orchestrator option.
    env_name: environment name recorded on rollouts.
  """

  dispatch: dispatcher_lib.DispatchConfig
  buffer: buffer_lib.BufferConfig
  num_steps: int
  train_seconds: float = 1.0
  num_slots: int | None = None
  tokens_per_second: float = 4.0
  max_new_tokens: int = 64
  mask_truncated_completions: bool = False
  env_name: str = "sim"


@dataclasses.dataclass(frozen=True)
class Dispatch:
  time: float
  group_id: int
  prompt_id: int
  dispatch_version: int
  batches_trained: int  # learner updates finished when the group was dispatched
  attempt: int


@dataclasses.dataclass(frozen=True)
class InFlight:
  """An in-flight group as the publish of `version` found it."""

  group_id: int
  dispatch_version: int
  first_sampled_version: int | None  # None: still waiting for a sampler slot


@dataclasses.dataclass(frozen=True)
class Publish:
  time: float
  version: int
  in_flight: tuple[InFlight, ...]  # before cancellation
  cancelled: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Cut:
  """A batch cut; `pending` lists, in dispatch order, the groups dispatched and
  neither retired nor taken when the policy chose (after the stale sweep):
  the dispatch queue that FIFO order refers to."""

  time: float
  batch: orchestrator_lib.Batch
  pending: tuple[int, ...]


@dataclasses.dataclass
class SimResult:
  dispatches: list[Dispatch]
  publishes: list[Publish]
  cuts: list[Cut]
  events: list[tuple[float, str, int]]  # (time, "dispatch" | "train", group id or version)
  orchestrator: orchestrator_lib.Orchestrator
  prompt_of: dict[int, object]  # group id -> prompt
  end_time: float


@dataclasses.dataclass
class _Running:
  request: dispatcher_lib.GroupRequest
  start: float | None = None
  end: float | None = None
  first_version: int | None = None  # version live when its first token was sampled


def simulate(cfg: SimConfig, prompts: Iterator, duration_fn: Callable[[object], float]
             ) -> SimResult:
  """Runs `cfg.num_steps` learner updates on the fake clock."""
  clock = FakeClock()
  orch = orchestrator_lib.Orchestrator(
      dispatch_cfg=cfg.dispatch, buffer_cfg=cfg.buffer, prompts=prompts,
      encode_fn=lambda prompt: [1], env_name_of=lambda prompt: cfg.env_name,
      max_new_tokens=cfg.max_new_tokens,
      mask_truncated_completions=cfg.mask_truncated_completions, clock=clock)
  heap: list[tuple[float, int, str, int]] = []
  seq = itertools.count()
  version = 0
  publish_times = [0.0]  # publish_times[v]: when version v went live
  running: dict[int, _Running] = {}  # dispatched, not finished, not cancelled
  waiting: collections.deque[int] = collections.deque()  # dispatched, no slot yet
  result = SimResult(dispatches=[], publishes=[], cuts=[], events=[], orchestrator=orch,
                     prompt_of={}, end_time=0.0)
  retired: set[int] = set()
  learner_busy = False
  current: orchestrator_lib.Batch | None = None

  def version_at(t: float) -> int:
    return bisect.bisect_right(publish_times, t) - 1

  def start_waiting() -> None:
    busy = sum(r.start is not None for r in running.values())
    while waiting and (cfg.num_slots is None or busy < cfg.num_slots):
      gid = waiting.popleft()
      run = running[gid]
      run.start, run.end = clock.now, clock.now + duration_fn(run.request.prompt)
      run.first_version = version
      orch.dispatcher.note_sampling(gid, version)
      heapq.heappush(heap, (run.end, next(seq), "finish", gid))
      busy += 1

  def sample() -> None:
    for request in orch.dispatcher.take(1 << 30, version, timeout=0.0):
      running[request.group_id] = _Running(request)
      waiting.append(request.group_id)
      result.prompt_of[request.group_id] = request.prompt
      result.dispatches.append(Dispatch(
          time=clock.now, group_id=request.group_id, prompt_id=request.prompt.prompt_id,
          dispatch_version=request.dispatch_version, batches_trained=version,
          attempt=request.attempt))
      result.events.append((clock.now, "dispatch", request.group_id))
    start_waiting()

  def finish(gid: int) -> None:
    run = running.pop(gid)
    orch.group_finished(_make_group(cfg, run, version_at))
    start_waiting()

  def try_train() -> None:
    nonlocal learner_busy, current
    if learner_busy or version >= cfg.num_steps:
      return
    pending = tuple(d.group_id for d in result.dispatches if d.group_id not in retired)
    batch = orch.try_cut(version)
    if batch is None:
      return
    retired.update(g.group_id for g in batch.stale)
    # What the assembly policy chose from: the sweep ran first.
    pending = tuple(gid for gid in pending if gid not in retired)
    result.cuts.append(Cut(time=clock.now, batch=batch, pending=pending))
    retired.update(g.group_id for g in batch.groups)
    learner_busy, current = True, batch
    heapq.heappush(heap, (clock.now + cfg.train_seconds, next(seq), "trained", version))

  def publish() -> None:
    nonlocal version, learner_busy
    version += 1
    publish_times.append(clock.now)
    in_flight = tuple(InFlight(
        group_id=gid, dispatch_version=run.request.dispatch_version,
        first_sampled_version=run.first_version)
        for gid, run in sorted(running.items()))
    cancelled = orch.publish(version, trained=current.groups)
    for gid in cancelled:
      running.pop(gid, None)
      if gid in waiting:
        waiting.remove(gid)
    retired.update(cancelled)
    result.publishes.append(Publish(time=clock.now, version=version, in_flight=in_flight,
                                    cancelled=tuple(cancelled)))
    result.events.append((clock.now, "train", version - 1))
    learner_busy = False

  orch.publish(0, trained=[])
  sample()
  try_train()
  while version < cfg.num_steps:
    if not heap:
      raise RuntimeError(f"simulation stalled at version {version}: nothing in flight and no "
                         "batch can be cut")
    clock.now, _, kind, payload = heapq.heappop(heap)
    if kind == "finish":
      if payload in running:  # cancelled groups' finish events are stale
        finish(payload)
    else:
      publish()
    sample()
    try_train()
  result.end_time = clock.now
  return result


def _make_group(cfg: SimConfig, run: _Running, version_at) -> rollout_lib.Group:
  request = run.request
  n = int(round((run.end - run.start) * cfg.tokens_per_second))
  length = min(max(n, 1), cfg.max_new_tokens)
  finish_reason = "length" if n > cfg.max_new_tokens else "stop"
  # Token i is sampled at the start of its share of the duration, under the
  # version live then (the first one under the version it was admitted with).
  times = run.start + (run.end - run.start) * np.arange(1, length) / length
  versions = np.array([run.first_version, *(version_at(t) for t in times)], np.int32)
  rollouts = [rollout_lib.Rollout(
      group_id=request.group_id, sample_index=s, prompt_ids=np.array([1], np.int32),
      completion_ids=np.full(length, 2, np.int32), loss_mask=np.ones(length, np.float32),
      behaviour_logprobs=np.full(length, -1.0, np.float32), token_versions=versions,
      dispatch_version=request.dispatch_version, finish_reason=finish_reason,
      reward=float(s % 2), env_name=cfg.env_name,
      timings={"queued": run.start - request.dispatch_time, "generating": run.end - run.start})
      for s in range(request.group_size)]
  return rollout_lib.Group(group_id=request.group_id, prompt_id=request.prompt.prompt_id,
                           dispatch_version=request.dispatch_version, rollouts=rollouts)
