"""The sampled held-out evaluation, beside training instead of inside it.

A sampled evaluation (`eval_samples` completions of every held-out prompt)
decodes n times the greedy pass's tokens. Run between two updates it stops
the learner for all of that. Here it runs in a thread of its own on the
sampler's devices (its own scheduler and runner, beside the rollout engine),
pinned to the published params of the version it evaluates: the learner
goes on updating and the engine on sampling meanwhile.

- At most one is in flight. The next one due first waits for it, so
  evaluations finish in order and a slow one holds training back by at most
  its own remainder (the wait is the `eval_sampled_wait_s` of the next row).
- Its row is written by the learner thread, the one writer of the records,
  at the first update after it finished (`collect`), at the step it
  evaluated. A checkpoint waits for one of an older version; one of its own
  version runs on and is noted, and a resume evaluates it again
  (`eval_log.EvalLog.before_checkpoint`), so a resumed run neither loses
  nor repeats one. The end of the run waits for the last one.
- An exception in it is re-raised in the learner thread, as a synchronous
  evaluation's would be.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable


@dataclasses.dataclass
class Finished:
  """A sampled evaluation that ran: what it evaluated, its result (the
  `Evaluator.sampled` dict), when it started and how long it took."""

  step: int
  phase: str
  result: dict
  started: float
  seconds: float
  waited: float  # seconds the learner waited for the one before it


class BackgroundSampledEval:
  """Runs `sampled_fn(params)` in a thread, one at a time."""

  def __init__(self, sampled_fn: Callable[[object], dict]):
    self._sampled_fn = sampled_fn
    self._thread: threading.Thread | None = None
    self._finished: list[Finished] = []
    self._error: BaseException | None = None
    self._lock = threading.Lock()
    self.running_step: int | None = None  # the step of the one in flight

  def submit(self, params, step: int, phase: str) -> None:
    """Starts evaluating `params` (pinned: this thread holds them) as of
    `step` of `phase`, after the one in flight, if any, finished."""
    waited = self.wait()
    self._raise_error()
    self.running_step = step

    def run() -> None:
      started = time.monotonic()
      try:
        result = self._sampled_fn(params)
      except BaseException as e:  # noqa: BLE001 - re-raised in the learner thread
        with self._lock:
          self._error = e
        return
      with self._lock:
        self._finished.append(Finished(step=step, phase=phase, result=result, started=started,
                                       seconds=time.monotonic() - started, waited=waited))

    self._thread = threading.Thread(target=run, name=f"sampled-eval-{step}", daemon=True)
    self._thread.start()

  def wait(self) -> float:
    """Waits for the one in flight; returns the seconds waited."""
    if self._thread is None:
      return 0.0
    start = time.monotonic()
    self._thread.join()
    self._thread, self.running_step = None, None
    return time.monotonic() - start

  def collect(self) -> list[Finished]:
    """The evaluations finished since the last call, oldest first (an error
    of one is raised here)."""
    self._raise_error()
    # (alive first: a thread seen ended has already added its result below, so
    # no finished evaluation is ever both unwritten and not `running_step`)
    ended = self._thread is not None and not self._thread.is_alive()
    with self._lock:
      done, self._finished = self._finished, []
    if ended:
      self._thread, self.running_step = None, None
    return done

  def _raise_error(self) -> None:
    with self._lock:
      error, self._error = self._error, None
    if error is not None:
      raise RuntimeError("the sampled evaluation failed") from error
