"""The learner loop: cut a batch, train, publish, record, save; then stop, one way.

One update (`_update`) runs as a unit that a signal never splits (signals
only set a flag, `stop.py`):

1. cut `B_u` (the buffer sweeps stale groups first) and assemble it;
2. in a multi-controller run, plan which process trains each rollout and
   tell the other processes (train this plan; evaluate after; save after);
   each process then fills its own rows (`distributed/shard_batch.py`);
3. the jitted update, then publish version `u + 1` to the sampler;
4. with the sampler held still: the orchestrator cancels the groups that can
   no longer ship and retires the trained ones (`groups.jsonl` events), and
   when this version is checkpointed, the open work is read at that instant;
5. the update's per-lag ratio statistics (on the host for its row anyway)
   go to the orchestrator, whose adaptive staleness bound decides the K of
   the next publish from them; evaluate if due, and write the update's
   `metrics.jsonl` row;
6. save the checkpoint, with the number of lines each record file has now,
   so a resume from it keeps exactly these records (`records.py`).

The stop sequence (`_stop`) is the only way out, whatever ended the loop (the
last step, a signal, the data running out, an error): stop dispatching,
finish the save in flight, evaluate once more when the data ran out, save the
final checkpoint once (if asked, if this version is not saved yet and the
state is sound), then close every component.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from arl_jax.core import schedule as schedule_lib
from arl_jax.core import train_batch as train_batch_lib
from arl_jax.distributed import lockstep
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import update as update_lib
from arl_jax.metrics import host_memory
from arl_jax.metrics import progress as progress_lib
from arl_jax.models import fingerprint
from arl_jax.orchestrator import adaptive_staleness
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.training import run_context
from arl_jax.training import step_record as step_record_lib


@dataclasses.dataclass
class LoopResult:
  """Attributes:
    version: the last version trained (the run's final version).
    groups_trained: groups trained since the run began (resumes included).
    batches: summaries of the trained batches (with `keep_batches`).
    complete: the run reached `num_steps`, or its data ran out (a rerun
      would train no more); False when a stop request ended it early.
    stop_reason: what asked it to stop early (`StopRequest.reason`), or "".

  (The step records are in `metrics.jsonl` only: a long run does not also
  hold them in memory.)
  """

  version: int
  groups_trained: int
  batches: list[dict]
  complete: bool = True
  stop_reason: str = ""


class LearnerLoop:
  """Trains until `num_steps`, a stop request, the end of the data or an error."""

  def __init__(self, run: run_context.RunContext, learner: run_context.Learner, *,
               orchestrator, rollouts, groups_trained: int, broadcast_fn=None, shards=None,
               start_saved: bool = True, keeper=None):
    """Args:
      run: the run (spec, writers, stop request, checkpoints, startup clock).
      learner: the learner it trains (its `state` and `version` move on).
      orchestrator: the run's orchestrator.
      rollouts: the rollout side (`rollouts.Rollouts`), started.
      groups_trained: groups trained before (a resumed run's count).
      broadcast_fn: `(step_index, lockstep.Step)` -> None, tells the other
        processes of a multi-controller run what to do next (None: alone).
      shards: a multi-controller run's `shard_batch.LeaderShards` (plans
        each batch, builds this process's rows; None: alone).
      start_saved: the starting version is saved already (a resumed one, or
        a fresh start's initial params). False after a warm-up: a stop
        before the first update then saves version 0, so that a rerun
        resumes instead of warming up again.
      keeper: the run's `schedule_follow.Keeper` (recording its schedule, or
        replaying a recorded one: each update, evaluation and save is
        written or checked, and rows carry `params_hash`), or None.

    The run's startup clock's phases go into the first update's progress
    line and metrics row; each update's row then holds `host_peak_gib`, the
    process's resident peak since the previous row (the clock's peak windows),
    and `memory.jsonl` a row at the end of the update, its evaluation and its
    checkpoint (`metrics/memory_log.py`).
    """
    self._run = run
    self._spec = run.spec
    self._learner = learner
    self._orchestrator = orchestrator
    self._rollouts = rollouts
    self._checkpointer = run.checkpointer
    self._stop_request = run.stop
    self._broadcast_fn = broadcast_fn
    self._shards = shards
    self._keeper = keeper
    # The rate each update trains at (`optim.make_optimizer` follows the same).
    self._rate = optim_lib.learning_rate(run.spec.optim, run.spec.run.num_steps)
    self.groups_trained = groups_trained
    self._saved_version = learner.version if start_saved else None
    self._batches: list[dict] = []
    self._learner_wait = 0.0  # seconds spent waiting for a batch
    self._blocking_s = 0.0  # seconds inside checkpoint saves, and waiting for them (`release`)
    self._data_exhausted = False
    self._first_step = learner.version

  @property
  def version(self) -> int:
    """The version trained last (the one the learner's state holds)."""
    return self._learner.version

  @property
  def params(self):
    """The params of the current version (what evaluation reads)."""
    return self._learner.params

  def run(self) -> LoopResult:
    failed = True
    self._progress = progress_lib.Progress(
        total=self._spec.run.num_steps, initial=self.version, log_every=self._spec.run.log_every,
        print_fn=self._run.print_fn, bar=progress_lib.wants_bar(self._run.print_fn),
        # (at the first update: the programs it compiled count)
        first_line_suffix=self._run.clock.summary)
    try:
      self._rl_start = self._last_time = time.monotonic()
      self._run.memory.row_peak()  # (the start-up's windows are the clock's, not update 0's)
      self._run.eval_log.rl_start = self._rl_start
      for step in range(self.version, self._spec.run.num_steps):
        batch = self._cut(step)
        if batch is None:
          break
        self._update(step, batch)
      failed = False
    finally:
      self._stop(failed)
    return LoopResult(version=self.version, groups_trained=self.groups_trained,
                      batches=self._batches, complete=self._complete,
                      stop_reason="" if self._complete else self._stop_request.reason)

  @property
  def _complete(self) -> bool:
    """Nothing is left to train: every update ran, or the data ran out."""
    return self.version >= self._spec.run.num_steps or self._data_exhausted

  # -- one update ---------------------------------------------------------------

  def _cut(self, step: int) -> orchestrator_lib.Batch | None:
    """`B_step`, or None when the loop must end (a stop request, or the data
    ran out); waiting, it keeps checking for both and for failures."""
    self._stop_request.phase = f"waiting for the batch of update {step}"
    start = time.monotonic()
    try:
      while not self._stop_request:
        try:
          return self._orchestrator.cut(self.version, timeout=0.5)
        except TimeoutError:
          self._rollouts.raise_if_failed()
      self._run.print_fn(f"stopping after {step} updates: {self._stop_request.reason}")
      return None
    except orchestrator_lib.NoSignal as e:
      self._stop_request.request(f"no signal: {e}")
      self._run.print_fn(f"stopping after {step} updates: {e}")
      return None
    except schedule_lib.ReplayStop as e:  # (where the recorded run stopped, or resumed)
      self._stop_request.request(str(e))
      self._run.print_fn(f"stopping after {step} updates: {e}")
      return None
    except orchestrator_lib.DataExhausted as e:
      self._run.print_fn(f"data exhausted after {step} updates (data.num_epochs="
                         f"{self._spec.data.num_epochs}): {e}")
      self._data_exhausted = True
      return None
    finally:
      self._learner_wait += time.monotonic() - start

  def _update(self, step: int, batch: orchestrator_lib.Batch) -> None:
    spec = self._spec
    self._stop_request.phase = f"update {step}"
    version = self.version + 1
    evaluate = self._eval_due(version)
    save = self._checkpointer is not None and self._checkpointer.should_save(version)
    host_batch = None
    if self._shards is None:
      host_batch = train_batch_lib.assemble(
          batch.groups, prompt_len=spec.engine.prompt_len,
          # Padded columns follow the batch's longest completion, not the budget.
          max_new_tokens=train_batch_lib.completion_budget(
              batch.groups, spec.engine.max_new_tokens, spec.packing),
          pad_id=self._run.pad_id, advantage_estimator=spec.loss.objective.advantage,
          mask_truncated_completions=spec.orchestrator.mask_truncated_completions,
          packing=spec.packing)
      train_on, shape = host_batch, host_batch.tokens.shape
      filled = float(np.mean(host_batch.token_mask))
    else:  # each process fills its rows of the plan
      plan = self._shards.plan(batch)
      self._broadcast_fn(step, lockstep.Step(lockstep.BATCH, plan=plan, evaluate=evaluate,
                                             save=save))
      train_on, shape = self._shards.local_batch(plan, batch), (plan.rows, plan.width)
      filled = float(np.sum(plan.prompt_length + plan.completion_length)) / (
          plan.rows * plan.width)
    learner = self._learner
    if self._checkpointer is not None:  # (a save reading the state's buffers keeps them)
      waited = self._checkpointer.release(learner.state)
      self._blocking_s += waited
      if waited:  # (the write's buffers, freed, would stay under the update: 1.2 GiB)
        self._run.memory.release_free()
    learner.state, update_metrics = learner.update_fn(learner.state, train_on)
    learner.version = version
    learner.publisher.publish(learner.state.params, version)
    self.groups_trained += len(batch.groups)
    snapshot_start = time.monotonic()
    with self._rollouts.paused():
      cancelled = self._orchestrator.publish(version, trained=batch.groups)
      self._rollouts.cancel(cancelled)
      run_record = self._run_record() if save else None
    update_metrics = jax.device_get(update_metrics)
    # (a recording's params fingerprint, computed by the update itself)
    sums = update_metrics.pop(update_lib.PARAMS_SUMS, None)
    params_hash = self._follow_schedule(step, version, batch, sums)
    self._orchestrator.observe_update(lag_stats(update_metrics))
    if run_record is not None:
      # The bound's state after this update's statistics (they reach the host
      # after the open work is read): a resume decides what this run decides next.
      run_record["staleness"] = self._orchestrator.bound_record()
    now = time.monotonic()
    record = step_record_lib.step_record(
        step=step, version=version, batch_shape=shape, batch_fill=filled, batch=batch,
        update_metrics=update_metrics,
        components={**self._orchestrator.metrics(), **self._rollouts.metrics(),
                    "checkpoint_blocking_s_total": self._blocking_s,
                    **({} if self._shards is None else
                       {"shard_token_bytes_received_total": self._shards.bytes_received})},
        step_seconds=now - self._last_time, rl_seconds=now - self._rl_start,
        learner_wait=self._learner_wait)
    self._last_time = now
    record["lr"] = float(self._rate(step))
    if params_hash is not None:
      record["params_hash"] = params_hash
    # At the mean pace so far (evaluations included).
    record["eta_s"] = (now - self._rl_start) / (step + 1 - self._first_step) * (
        spec.run.num_steps - step - 1)
    if run_record is not None:
      # The learner's pause to read the open work, and how much sampled work
      # the checkpoint keeps.
      work = run_record["work"]
      record.update(checkpoint_snapshot_s=time.monotonic() - snapshot_start,
                    checkpoint_open_groups=len(work.groups), checkpoint_open_tokens=work.tokens)
    memory = self._run.memory
    memory.note("update", version)
    if evaluate:  # (the sampled pass reads this version as published)
      if self._keeper is not None:
        self._keeper.evaluated(version)
      record["eval_reward"] = self._run.eval_log(self.params, version, "rl",
                                                 published=learner.publisher.latest()[1])
      memory.note("eval", version)
    sampled = self._run.eval_log.collect()  # (rows of sampled evaluations that finished)
    if sampled:  # (the newest sampled pass@k, for the progress line)
      record["eval_pass_at_k"] = sampled
    if step == self._first_step:
      record.update(self._run.clock.record())
    peak = memory.row_peak()  # (the update's window, the evaluation's, a checkpoint before)
    if peak is not None:
      record["host_peak_gib"] = host_memory.gib(peak)
    self._run.writer.write({"phase": "rl", **record})
    if self._run.keep_batches and host_batch is not None:
      self._batches.append(step_record_lib.batch_summary(batch, host_batch))
    self._progress.update(record)
    if run_record is not None:
      self._save(run_record)
      memory.note("checkpoint", version)

  def _follow_schedule(self, step: int, version: int, batch, sums) -> str | None:
    """Writes the update into the run's schedule, or checks it against the
    recorded one (`schedule.ReplayDiverged` names what differs); returns
    the params' fingerprint (from their `sums`, which the update returned;
    None: neither recording nor replaying)."""
    if self._keeper is None:
      return None
    rollouts = [r for g in batch.groups for r in g.rollouts]
    ids = np.array([(r.group_id, r.sample_index) for r in rollouts], np.int64)
    params_hash = fingerprint.from_sums(self._learner.state.params, sums)
    self._keeper.updated(
        step, version, params=params_hash,
        tokens=schedule_lib.digest(ids.tobytes(), *(
            np.asarray(r.completion_ids, np.int64).tobytes() + b"|" for r in rollouts)),
        versions=schedule_lib.digest(*(
            np.asarray(r.token_versions, np.int64).tobytes() + b"|" for r in rollouts)))
    return params_hash

  def _eval_due(self, version: int) -> bool:
    every = self._spec.run.eval_every
    return bool(self._run.eval_log.enabled and every
                and (version % every == 0 or version == self._spec.run.num_steps))

  def _run_record(self) -> dict:
    """What a resume needs besides the TrainState (JSON), read while the
    rollouts are held still: the open work, the drop ledger, every
    component's counters, and the config."""
    return {"version": self.version, **self._orchestrator.snapshot(self._rollouts.open_segments()),
            "counters": {"groups_trained": self.groups_trained,
                         "rollouts": self._rollouts.state_dict()},
            "config": self._run.config,
            **({} if self._learner.base is None else {"base": self._learner.base})}

  def _save(self, run_record: dict, final: bool = False) -> None:
    if self._keeper is not None:  # (the event counts among the lines this save keeps)
      self._keeper.saved(self.version, final)
    # How many lines of each record file belong to this checkpoint's run.
    pending = self._run.eval_log.before_checkpoint(self.version)
    if pending is not None:  # (still running: a resume from here evaluates it again)
      run_record["sampled_eval_pending"] = pending
    run_record["records"] = {"metrics.jsonl": self._run.writer.lines,
                             "groups.jsonl": self._run.audit.lines}
    schedule_lines = None if self._keeper is None else self._keeper.flush()
    if schedule_lines is not None:
      run_record["records"]["schedule.jsonl"] = schedule_lines
    start = time.monotonic()
    if self._shards is not None:  # the held groups' arrays, from their processes
      self._shards.collect(run_record)
    run_record["work"] = run_record["work"].to_json()
    self._checkpointer.save(self.version, self._learner.state, run_record, self._learner.reference)
    self._blocking_s += time.monotonic() - start
    self._saved_version = self.version

  # -- the stop sequence -------------------------------------------------------------

  def _stop(self, failed: bool) -> None:
    """Runs whatever ended the loop (see the module docstring)."""
    self._stop_request.phase = "stopping"
    self._progress.close()  # (what follows prints plain lines)
    spec = self._spec
    try:
      self._orchestrator.dispatcher.close()  # nothing new starts; what runs, runs on
      final_eval = (not failed and self._data_exhausted and self._run.eval_log.enabled
                    and spec.run.eval_every and self.version % spec.run.eval_every != 0)
      # Not after an error, nor over a state whose buffers an interrupted
      # update donated, nor with a sampler whose slots cannot be read.
      save_final = (self._checkpointer is not None and spec.checkpoint.save_final
                    and not failed and self.version != self._saved_version
                    and not self._rollouts.failed
                    and not any(x.is_deleted() for x in jax.tree.leaves(self._learner.state)))
      if self._broadcast_fn is not None:  # the other processes stop with us
        self._broadcast_fn(spec.run.num_steps, lockstep.Step(
            lockstep.STOP, evaluate=bool(final_eval), save=bool(save_final),
            complete=self._complete))
      if self._checkpointer is not None:
        self._stop_request.phase = "finishing the checkpoint being written"
        self._checkpointer.wait()
      if final_eval:
        self._run.eval_log(self.params, self.version, "rl",
                           published=self._learner.publisher.latest()[1])
      if not failed:  # (nothing is lost: the sampled evaluation in flight finishes)
        self._stop_request.phase = "finishing the sampled evaluation"
        self._run.eval_log.collect(wait=True)
      if save_final:
        self._stop_request.phase = "saving the final checkpoint"
        with self._rollouts.paused():
          run_record = self._run_record()
        self._save(run_record, final=True)
    finally:
      try:
        if self._checkpointer is not None:
          self._checkpointer.close()  # waits for the last save
      finally:
        self._orchestrator.close()
        self._rollouts.stop()


def lag_stats(update_metrics: dict) -> list[adaptive_staleness.LagStat]:
  """The update's per-lag-bucket ESS and trained tokens (host numbers), as
  the adaptive staleness bound reads them."""
  tokens = float(update_metrics["trained_tokens"])
  return [adaptive_staleness.LagStat(
      lo=lo, hi=hi, ess=float(update_metrics[f"ess_lag{name}"]),
      tokens=float(update_metrics[f"token_fraction_lag{name}"]) * tokens)
          for name, lo, hi in update_lib.LAG_BUCKETS]
