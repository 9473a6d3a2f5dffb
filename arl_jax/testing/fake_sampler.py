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
  `train_seconds`, then publishes `u + 1` (which cancels what can no longer
  ship) and hands the orchestrator what it measured of `B_u` per lag
  (`lag_stats_fn`, for the adaptive staleness bound), in that order, as
  `training/learner_loop.py` does.

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

from arl_jax.core import group_request as group_request_lib
from arl_jax.core import rollout as rollout_lib
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.orchestrator import orchestrator_config


class FakeClock:
  """Simulated seconds; the orchestrator reads it like `time.monotonic`."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
  """Attributes:
    orchestrator: the orchestrator's settings, as in a real run.
    num_steps: learner updates to simulate.
    train_seconds: simulated duration of one learner update.
    num_slots: groups the fake sampler generates at once (None: all admitted).
    tokens_per_second: completion length of a group is `duration * this`,
      capped at `max_new_tokens` (capped completions finish with `length`).
    max_new_tokens: the completion budget.
    reward_fn: `(prompt, sample index) -> reward` (None: index % 2, so every
      group's rewards differ).
    env_name: environment name recorded on rollouts.
    lag_stats_fn: `B_u` -> the learner's per-lag measurements of it
      (`adaptive_staleness.LagStat`s; None: nothing is measured).
  """

  orchestrator: orchestrator_config.OrchestratorConfig
  num_steps: int
  train_seconds: float = 1.0
  num_slots: int | None = None
  tokens_per_second: float = 4.0
  max_new_tokens: int = 64
  reward_fn: Callable[[object, int], float] | None = None
  env_name: str = "sim"
  lag_stats_fn: Callable[[orchestrator_lib.Batch], list] | None = None


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
  request: group_request_lib.GroupRequest
  start: float | None = None
  end: float | None = None
  first_version: int | None = None  # version live when its first token was sampled


def simulate(cfg: SimConfig, prompts: Iterator, duration_fn: Callable[[object], float]
             ) -> SimResult:
  """Runs `cfg.num_steps` learner updates on the fake clock."""
  return _Simulation(cfg, prompts, duration_fn).run()


class _Simulation:
  """The event loop of `simulate`: a heap of `(time, seq, kind, payload)`
  events (`finish` a group, `trained` a batch) on a fake clock, driving the
  real orchestrator as the sampler and the learner would."""

  def __init__(self, cfg: SimConfig, prompts: Iterator, duration_fn):
    self.cfg, self.duration_fn = cfg, duration_fn
    self.clock = FakeClock()
    self.orch = orchestrator_lib.Orchestrator(
        cfg.orchestrator, prompts=prompts,
        encode_fn=lambda prompt: [1], env_name_of=lambda prompt: cfg.env_name,
        max_new_tokens=cfg.max_new_tokens, clock=self.clock)
    self.heap: list[tuple[float, int, str, int]] = []
    self.seq = itertools.count()
    self.version = 0
    self.publish_times = [0.0]  # publish_times[v]: when version v went live
    self.running: dict[int, _Running] = {}  # dispatched, not finished, not cancelled
    self.waiting: collections.deque[int] = collections.deque()  # dispatched, no slot yet
    self.result = SimResult(dispatches=[], publishes=[], cuts=[], events=[],
                            orchestrator=self.orch, prompt_of={}, end_time=0.0)
    self.retired: set[int] = set()
    self.learner_busy = False
    self.current: orchestrator_lib.Batch | None = None

  def run(self) -> SimResult:
    self.orch.publish(0, trained=[])
    self.sample()
    self.try_train()
    while self.version < self.cfg.num_steps:
      if not self.heap:
        raise RuntimeError(f"simulation stalled at version {self.version}: nothing in flight "
                           "and no batch can be cut")
      self.clock.now, _, kind, payload = heapq.heappop(self.heap)
      if kind == "finish":
        if payload in self.running:  # cancelled groups' finish events are stale
          self.finish(payload)
      else:
        self.publish()
      self.sample()
      self.try_train()
    self.result.end_time = self.clock.now
    return self.result

  def version_at(self, t: float) -> int:
    return bisect.bisect_right(self.publish_times, t) - 1

  def start_waiting(self) -> None:
    busy = sum(r.start is not None for r in self.running.values())
    while self.waiting and (self.cfg.num_slots is None or busy < self.cfg.num_slots):
      gid = self.waiting.popleft()
      run = self.running[gid]
      run.start = self.clock.now
      run.end = self.clock.now + self.duration_fn(run.request.prompt)
      run.first_version = self.version
      self.orch.dispatcher.note_sampling(gid, self.version)
      heapq.heappush(self.heap, (run.end, next(self.seq), "finish", gid))
      busy += 1

  def sample(self) -> None:
    for request in self.orch.dispatcher.take(1 << 30, self.version, timeout=0.0):
      self.running[request.group_id] = _Running(request)
      self.waiting.append(request.group_id)
      self.result.prompt_of[request.group_id] = request.prompt
      self.result.dispatches.append(Dispatch(
          time=self.clock.now, group_id=request.group_id, prompt_id=request.prompt.prompt_id,
          dispatch_version=request.dispatch_version, batches_trained=self.version,
          attempt=request.attempt))
      self.result.events.append((self.clock.now, "dispatch", request.group_id))
    self.start_waiting()

  def finish(self, gid: int) -> None:
    run = self.running.pop(gid)
    if not self.orch.group_finished(_make_group(self.cfg, run, self.version_at)):
      self.retired.add(gid)  # (dropped by dynamic sampling)
    self.start_waiting()

  def try_train(self) -> None:
    if self.learner_busy or self.version >= self.cfg.num_steps:
      return
    pending = tuple(d.group_id for d in self.result.dispatches
                    if d.group_id not in self.retired)
    batch = self.orch.try_cut(self.version)
    if batch is None:
      return
    self.retired.update(g.group_id for g in batch.stale)
    # What the assembly policy chose from: the sweep ran first.
    pending = tuple(gid for gid in pending if gid not in self.retired)
    self.result.cuts.append(Cut(time=self.clock.now, batch=batch, pending=pending))
    self.retired.update(g.group_id for g in batch.groups)
    self.learner_busy, self.current = True, batch
    heapq.heappush(self.heap, (self.clock.now + self.cfg.train_seconds, next(self.seq),
                               "trained", self.version))

  def publish(self) -> None:
    self.version += 1
    self.publish_times.append(self.clock.now)
    in_flight = tuple(InFlight(
        group_id=gid, dispatch_version=run.request.dispatch_version,
        first_sampled_version=run.first_version)
        for gid, run in sorted(self.running.items()))
    cancelled = self.orch.publish(self.version, trained=self.current.groups)
    if self.cfg.lag_stats_fn is not None:
      self.orch.observe_update(self.cfg.lag_stats_fn(self.current))
    for gid in cancelled:
      self.running.pop(gid, None)
      if gid in self.waiting:
        self.waiting.remove(gid)
    self.retired.update(cancelled)
    self.result.publishes.append(Publish(time=self.clock.now, version=self.version,
                                         in_flight=in_flight, cancelled=tuple(cancelled)))
    self.result.events.append((self.clock.now, "train", self.version - 1))
    self.learner_busy = False


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
      reward=float(s % 2 if cfg.reward_fn is None else cfg.reward_fn(request.prompt, s)),
      env_name=cfg.env_name,
      timings={"queued": run.start - request.dispatch_time, "generating": run.end - run.start})
      for s in range(request.group_size)]
  return rollout_lib.Group(group_id=request.group_id, prompt_id=request.prompt.prompt_id,
                           dispatch_version=request.dispatch_version, rollouts=rollouts)
