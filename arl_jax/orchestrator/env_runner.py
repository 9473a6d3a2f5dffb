"""Scores finished groups in a worker pool, off the sampler thread.

Environments are plain Python. A fault in one (an exception) marks that rollout
`error` with reward 0, is counted per environment, and never stops the run; the
learner masks errored rollouts out of the loss (see `train_batch.py`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

from arl_jax import rollout as rollout_lib
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib


class EnvRunner:
  """Thread pool that scores each group's rollouts and hands the group to the buffer."""

  def __init__(self, env, buffer: buffer_lib.RolloutBuffer, num_workers: int = 2):
    self._env = env
    self._buffer = buffer
    self._pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="env")
    self._lock = threading.Lock()
    self.errors: collections.Counter[str] = collections.Counter()
    self._failure: BaseException | None = None

  def submit(self, request: dispatcher_lib.GroupRequest,
             rollouts: list[rollout_lib.Rollout]) -> None:
    self._pool.submit(self._score_group, request, rollouts).add_done_callback(self._check)

  def _check(self, future: concurrent.futures.Future) -> None:
    # A failure outside `env.score` (a bug, not an environment fault) would
    # lose the group and stall the batch it belongs to: keep it for the
    # learner, which raises it instead of waiting forever.
    if not future.cancelled() and future.exception() is not None:
      with self._lock:
        self._failure = self._failure or future.exception()

  def raise_if_failed(self) -> None:
    with self._lock:
      if self._failure is not None:
        raise RuntimeError("environment worker failed") from self._failure

  def _score_group(self, request, rollouts) -> None:
    for r in rollouts:
      start = time.monotonic()
      r.env_name = self._env.name
      try:
        r.reward = float(self._env.score(request.prompt, r.completion_ids))
      except Exception:  # noqa: BLE001 - an environment fault is data, not a crash
        r.reward = 0.0
        r.finish_reason = "error"
        with self._lock:
          self.errors[self._env.name] += 1
      r.timings["in_env"] = time.monotonic() - start
    self._buffer.put(rollout_lib.Group(
        group_id=request.group_id, prompt_id=request.prompt.prompt_id,
        dispatch_version=request.dispatch_version, rollouts=rollouts))

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
