"""The orchestrator: the learner's side of asynchronous control (docs/design.md section 4).

It owns the dispatcher (admission, cancellation, requeueing), the rollout
buffer (staleness sweep, assembly policy) and the drop ledger, and applies
them in one fixed order:

- env workers hand in finished groups (`group_finished`), stamped with the
  version live on arrival; with `filter_zero_variance`, a group whose rewards
  do not differ is dropped there and then (`zero_variance.py`), counted by
  the learner thread at its next call;
- the learner cuts `B_u` (`cut`): every attempt sweeps stale groups first,
  retires them at once (so they never hold admission capacity while the
  learner waits) and counts them;
- after the update the learner publishes `u + 1` (`publish`): the staleness
  bound decided since the last publish comes into force (dispatcher and
  buffer), in-flight groups that can no longer ship under it are cancelled,
  then the trained groups are retired, so the capacity they free is spent on
  the new version;
- once the update's metrics reach the host, the learner hands over its
  per-lag measurements (`observe_update`): the adaptive policy decides the
  bound of the next publish from them (`adaptive_staleness.py`).

Every decision depends only on the order of these calls and on the injected
clock, so `testing.fake_sampler` replays whole runs deterministically with a
fake sampler and a fake clock, through exactly this code.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from arl_jax.core import rollout as rollout_lib
from arl_jax.orchestrator import (
  adaptive_staleness,
  open_work,
  orchestrator_config,
  reward_shaping,
  schedule_follow,
  staleness,
  work_record,
  zero_variance,
)
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import drop_ledger as drop_ledger_lib


def histogram(values) -> dict[str, int]:
  """`{"value": count}` of integer values, for JSON lines."""
  keys, counts = np.unique(np.asarray(values, np.int64), return_counts=True)
  return {str(int(k)): int(c) for k, c in zip(keys, counts)}


@dataclasses.dataclass
class Batch:
  """A cut batch: its groups, the groups swept as stale since the previous
  batch, and this batch's masked rollouts by reason (`env_error`, `truncated`)."""

  batch_version: int
  groups: list[rollout_lib.Group]
  stale: list[rollout_lib.Group]
  masked: collections.Counter
  staleness_reference: str

  def rollout_lags(self) -> np.ndarray:
    """`[rollouts]` int32: each rollout's lag (its group's), in batch order."""
    return np.array([staleness.lag(self.batch_version, g, self.staleness_reference)
                     for g in self.groups for _ in g.rollouts], np.int32)

  def lag_metrics(self) -> dict:
    """Per-group lag and its split into versions that passed while the group
    was in flight (reference -> arrival in the buffer) and while it waited in
    the buffer (arrival -> this batch); one entry per group."""
    lags, in_flight, in_queue = [], [], []
    for g in self.groups:
      reference = staleness.reference_version(g, self.staleness_reference)
      lags.append(self.batch_version - reference)
      in_flight.append(g.arrival_version - reference)
      in_queue.append(self.batch_version - g.arrival_version)
    return {
        "lag_mean": float(np.mean(lags)), "lag_max": int(np.max(lags)),
        "lag_histogram": histogram(lags),
        "lag_in_flight_mean": float(np.mean(in_flight)),
        "lag_in_flight_histogram": histogram(in_flight),
        "lag_in_queue_mean": float(np.mean(in_queue)),
        "lag_in_queue_histogram": histogram(in_queue),
    }


class DataExhausted(Exception):
  """The prompt stream ended and what is left cannot fill another batch."""


class NoSignal(Exception):
  """Dynamic sampling dropped every group for a long time: the rewards do not
  differ within any group, so there is nothing to train on."""


class Orchestrator:
  """Dispatcher + buffer + drop ledger, driven by the learner thread."""

  def __init__(self, cfg: orchestrator_config.OrchestratorConfig, *, prompts: Iterator,
               encode_fn, env_name_of: Callable[[object], str], max_new_tokens: int,
               clock: Callable[[], float] = time.monotonic,
               budget_fn: Callable[[object], int | None] | None = None,
               audit_fn: Callable[[dict], None] | None = None,
               keeper: schedule_follow.Keeper | None = None):
    """Args:
      cfg: the config's `orchestrator` section (its dispatcher and buffer
        read it too).
      prompts: iterator of prompt records.
      encode_fn: prompt record -> its token ids.
      env_name_of: prompt record -> its environment's name.
      max_new_tokens: the sampler's completion budget.
      clock: time source (tests and the simulator pass a fake one).
      budget_fn: prompt record -> its own completion budget, or None.
      audit_fn: receives one event per retired group (`groups.jsonl`).
      keeper: records the cuts, cancellations and arrivals in the run's
        schedule, or has them follow a recorded one (None: neither).
    """
    self.cfg = cfg
    self._keeper = keeper
    self.buffer = buffer_lib.RolloutBuffer(cfg, clock)
    # Every open group at its restart points, for checkpoints: owned here,
    # opened and closed by the dispatcher, fed by the rollout side through
    # `segment_ended`, `episode_resumed` and `rollout_scored`.
    self.work = open_work.OpenWork()
    self.dispatcher = dispatcher_lib.Dispatcher(cfg, prompts, encode_fn, self.buffer,
                                                clock, budget_fn, work=self.work)
    self.ledger = drop_ledger_lib.DropLedger(max_new_tokens, cfg.mask_truncated_completions)
    self._env_name_of = env_name_of  # prompt record -> environment name
    # A stream whose draws depend on the rewards (a curriculum) is told each
    # finished group's; its own numbers join the step records.
    self._observe_fn = getattr(prompts, "observe", None)
    self._stream_metrics_fn = getattr(prompts, "metrics", None)
    # Receives one event per retired group: trained, or dropped as stale or
    # cancelled (`groups.jsonl`: the run's record of what happened to each prompt).
    self._audit_fn = audit_fn or (lambda event: None)
    self._lock = threading.Lock()
    self._live_version = 0
    self._stale_since_cut: list[rollout_lib.Group] = []
    self._max_new_tokens = max_new_tokens
    # Dynamic sampling: groups dropped on arrival (env threads) wait here for
    # the learner thread, which owns the ledger and the audit; the kept share
    # over the last four batches' worth of arrivals is admission's expected yield.
    self._zero_variance: list[tuple[rollout_lib.Group, int]] = []
    self.kept = zero_variance.KeptFraction(4 * cfg.groups_per_batch)
    # The staleness bound (learner thread): decided by `observe_update`, put
    # in force by `publish` in the dispatcher and the buffer.
    self.bound = adaptive_staleness.AdaptiveBound(cfg.staleness, cfg.max_off_policy_steps)

  @property
  def live_version(self) -> int:
    with self._lock:
      return self._live_version

  def group_finished(self, group: rollout_lib.Group) -> bool:
    """A group's last rollout was scored (env worker threads). False: it was
    cancelled meanwhile, or dropped by dynamic sampling, and nothing keeps it."""
    # The sampler may hold a version before `publish` announces it here; the
    # group cannot have arrived before the newest version that sampled it.
    newest = max(r.version_span[1] for r in group.rollouts)
    if self._observe_fn is not None:  # (the environment's own score: a judged run's rule part)
      self._observe_fn(group.prompt_id, [r.reward_parts.get("rule", r.reward)
                                         for r in group.rollouts])
    group = self._shaped(group)
    if self.cfg.filter_zero_variance:
      kept = zero_variance.carries_signal(group, self.cfg.mask_truncated_completions)
      if not kept and self.dispatcher.drop_finished(group.group_id) is None:
        return False  # cancelled meanwhile: counted as that
      with self._lock:
        self.kept.add(kept)
        share = self.kept.expected_yield()
        if not kept:
          self._zero_variance.append((group, max(self._live_version, newest)))
      self.dispatcher.set_expected_yield(share)
      if not kept:
        return False
    # Into the buffer before it stops counting as in flight, so that a learner
    # that sees the dispatcher drained has seen every group (see `cut`).
    arrival = max(self.live_version, newest)
    if self._keeper is not None:
      arrival = self._keeper.arrival_version(group.group_id, arrival)
    kept = self.buffer.put(group, arrival)
    if kept:
      self.work.arrived(group.group_id, group.arrival_version)
      if self._keeper is not None:
        self._keeper.arrived(group.group_id, arrival)
    self.dispatcher.finished_generating(group.group_id)
    return kept

  def _shaped(self, group: rollout_lib.Group) -> rollout_lib.Group:
    """`group` with the overlong penalty, measured against its prompt's own
    completion budget (an environment may give a prompt less than the
    sampler's `max_new_tokens`)."""
    budget = self.dispatcher.completion_budget(group.group_id, self._max_new_tokens)
    return reward_shaping.shape(group, budget, self.cfg.overlong_buffer,
                                self.cfg.overlong_penalty)

  def restore_work(self, work: work_record.WorkRecord) -> list[open_work.RestoredGroup]:
    """Takes back the open work of a checkpoint (`Dispatcher.snapshot_work`),
    before anything is dispatched: saved complete groups go back into the
    buffer at the version they arrived at (the staleness sweep judges them as
    before); the rest is returned for the sampler and the env runner."""
    restored = self.dispatcher.restore_work(work)
    for group in restored:
      if group.complete is not None:
        # (saved rewards are the environment's: shaped here, as on arrival)
        complete = self._shaped(group.complete)
        arrival = group.arrival_version
        self.buffer.put(complete, self.live_version if arrival is None else arrival)
        self.work.arrived(complete.group_id, complete.arrival_version)
    return restored

  def try_cut(self, batch_version: int) -> Batch | None:
    """One attempt at `B_{batch_version}`: sweep, count and retire stale groups,
    then take a batch if the assembly policy has one ready."""
    self._count_zero_variance()
    keeper = self._keeper
    if keeper is not None and keeper.replaying:  # the recorded attempt, once its groups are in
      event = keeper.cut_due(batch_version)
      result = self.buffer.take_exactly(batch_version, event["stale"], event["g"])
      if result is None:
        return None
      keeper.consume()
    else:
      result = self.buffer.try_cut(batch_version, self.cfg.groups_per_batch)
      if keeper is not None:
        keeper.cut(batch_version, result.stale, result.groups)
    if result.stale:
      self.ledger.record_stale(result.stale)
      self.dispatcher.retire([g.group_id for g in result.stale], dropped=True)
      for g in result.stale:
        self._audit(g.group_id, g.prompt_id, "dropped_stale", batch_version, g.dispatch_version)
      self._stale_since_cut.extend(result.stale)
    if result.groups is None:
      return None
    masked = self.ledger.record_trained(result.groups)
    stale, self._stale_since_cut = self._stale_since_cut, []
    return Batch(batch_version=batch_version, groups=result.groups, stale=stale, masked=masked,
                 staleness_reference=self.cfg.staleness_reference)

  def cut(self, batch_version: int, timeout: float | None = None) -> Batch:
    """Blocks until `B_{batch_version}` can be cut.

    Raises:
      buffer.BufferClosed: if the buffer is closed while waiting.
      TimeoutError: if `timeout` seconds pass without a full batch.
      DataExhausted: if the prompt stream ended and the groups left cannot
        fill the batch.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      generation = self.buffer.generation
      batch = self.try_cut(batch_version)
      if batch is not None:
        return batch
      self._raise_if_no_signal()
      if self.buffer.closed:
        raise buffer_lib.BufferClosed()
      if self.dispatcher.drained and self.buffer.generation == generation:
        raise DataExhausted(f"the prompt stream ended; {len(self.buffer)} finished groups "
                            f"cannot fill B_{batch_version}")
      remaining = None if deadline is None else deadline - time.monotonic()
      if remaining is not None and remaining <= 0:
        raise TimeoutError(f"no full batch of {self.cfg.groups_per_batch} groups "
                           f"for B_{batch_version}")
      self.buffer.wait_for_change(generation, 0.5 if remaining is None else min(remaining, 0.5))

  def _raise_if_no_signal(self) -> None:
    with self._lock:
      in_a_row = self.kept.dropped_in_a_row
    if in_a_row >= zero_variance.no_signal_groups(self.cfg.groups_per_batch):
      raise NoSignal(
          f"orchestrator.filter_zero_variance dropped the last {in_a_row} groups in a row: no "
          f"group's rewards differed (every sample right, or every one wrong), so nothing "
          f"could train; the task is too hard or too easy for this policy (a supervised "
          f"warm-up, another task mix), or turn the filter off")

  def _count_zero_variance(self) -> None:
    """Counts and audits the groups dynamic sampling dropped since the last
    call (learner thread)."""
    with self._lock:
      dropped, self._zero_variance = self._zero_variance, []
    for group, version in dropped:
      self.ledger.record_zero_variance(group)
      self._audit(group.group_id, group.prompt_id, "dropped_zero_variance", version,
                  group.dispatch_version)

  def publish(self, version: int, trained: list[rollout_lib.Group]) -> list[int]:
    """Announces a published version: cancels the in-flight groups that can no
    longer ship (returned, for the sampler and env workers to stop), then
    retires the groups trained by the update that produced it."""
    self._count_zero_variance()
    with self._lock:
      self._live_version = version
    self._put_bound_in_force(version)
    cancelled = self.dispatcher.on_publish(
        version, None if self._keeper is None else self._keeper.cancellations_due(version))
    if self._keeper is not None:
      self._keeper.published(version, [r.group_id for r in cancelled])
    for request in cancelled:
      self.ledger.record_cancelled(request.prompt.prompt_id, self._env_name_of(request.prompt),
                                   request.group_size)
      self._audit(request.group_id, request.prompt.prompt_id, "dropped_cancelled", version,
                  request.dispatch_version)
    self.dispatcher.retire([g.group_id for g in trained])
    for g in trained:  # trained by the update that produced `version`
      self._audit(g.group_id, g.prompt_id, "trained", version, g.dispatch_version)
    return [r.group_id for r in cancelled]

  def observe_update(self, stats: list[adaptive_staleness.LagStat]
                     ) -> adaptive_staleness.Decision:
    """The learner's per-lag measurements of the update just made (host
    numbers); the bound they decide comes into force at the next publish."""
    return self.bound.observe(stats)

  def bound_record(self) -> dict:
    """The staleness bound's whole state as it stands (JSON), as `snapshot`
    holds it; the learner loop takes it again after an update's statistics
    are observed, which is after the open work was read."""
    return self.bound.to_json()

  def _put_bound_in_force(self, version: int) -> None:
    k = self.bound.apply(version)
    if k != self.dispatcher.bound:  # (the fixed policy's never changes)
      self.dispatcher.set_bound(k)
      self.buffer.set_bound(k)

  # -- restart points, as the rollout side hands episodes on -------------------

  def segment_ended(self, episode) -> None:
    """`episode`'s segment ended; it goes to its environment."""
    self.work.at_env(episode)

  def episode_resumed(self, episode) -> None:
    """`episode` goes back to the sampler after an observation."""
    self.work.at_sampler(episode)

  def rollout_scored(self, rollout: rollout_lib.Rollout) -> None:
    """A rollout was scored (its group may still be generating)."""
    self.work.scored(rollout)

  def metrics(self) -> dict:
    """Drops (cumulative, in rollouts: drop_ledger.py), cancellations,
    requeues and what is in the system now, for the step records."""
    self._count_zero_variance()
    dispatcher = self.dispatcher
    metrics = {**self.ledger.metrics(), "cancelled_groups": dispatcher.num_cancelled,
               "requeued_groups": dispatcher.num_requeued, "buffer_size": len(self.buffer),
               "in_system_groups": dispatcher.in_system, **self.bound.metrics()}
    if self.cfg.filter_zero_variance:
      with self._lock:
        metrics["zero_variance_kept_fraction"] = self.kept.overall
      metrics["admission_yield"] = dispatcher.expected_yield
    if self._stream_metrics_fn is not None:
      metrics.update(self._stream_metrics_fn())
    return metrics

  def snapshot(self, open_segments: dict) -> dict:
    """The orchestrator's part of a checkpoint: the open work (a
    `work_record.WorkRecord`: every group in flight or in the buffer at its
    restart point, with the prompt stream's position;
    `Dispatcher.snapshot_work`), the drop ledger, the kept fraction and the
    staleness bound's state (JSON).

    Args:
      open_segments: what each occupied sampler slot has sampled of its
        current segment (`SamplerEngine.open_segments`), read at the same
        instant: the caller holds the sampler still meanwhile.
    """
    self._count_zero_variance()
    with self._lock:
      kept = self.kept.to_json()
    return {"work": self.dispatcher.snapshot_work(open_segments),
            "drop_ledger": self.ledger.to_json(), "zero_variance": kept,
            "staleness": self.bound_record()}

  def restore(self, saved: dict) -> list[open_work.RestoredGroup]:
    """Takes back a `snapshot` (before anything is dispatched); returns the
    groups whose parts go back to the sampler and the env workers."""
    restored = self.restore_work(saved["work"])
    self.ledger.restore(saved["drop_ledger"])
    if "zero_variance" in saved:  # (checkpoints before dynamic sampling lack it)
      self.kept.restore(saved["zero_variance"])
    if "staleness" in saved:  # (nor before the adaptive bound)
      self.bound.restore(saved["staleness"])
      self.dispatcher.set_bound(self.bound.applied_k)
      self.buffer.set_bound(self.bound.applied_k)
    return restored

  def _audit(self, group_id: int, prompt_id: int, event: str, version: int,
             dispatch_version: int) -> None:
    self._audit_fn({"event": event, "version": version, "group_id": group_id,
                    "prompt_id": prompt_id, "dispatch_version": dispatch_version})

  def close(self) -> None:
    self.dispatcher.close()
    self.buffer.close()
