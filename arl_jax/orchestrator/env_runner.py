"""Runs environments on finished segments in a worker pool, off the sampler thread.

For every segment the engine hands over, a worker either asks a multi-turn
environment for its next observation and hands the episode back to the engine
(`resume_fn`), or ends the episode: scores it, and once all G episodes of a
group have ended, passes the `Group` on (`on_group_fn`).

Environment faults are data, not crashes: an exception or a call that outlives
`timeout_s` marks the rollout `error` with reward 0, is counted per environment
(timeouts also separately), and the run goes on; the learner masks errored
rollouts out of the loss (see `train_batch.py`). A timed-out call is abandoned
on a daemon thread (Python cannot kill a thread) and its late answer ignored.
"""

from __future__ import annotations

import collections
import concurrent.futures
import operator
import threading
import time
from collections.abc import Callable

from arl_jax.core import episode as episode_lib
from arl_jax.core import rollout as rollout_lib
from arl_jax.envs import env_api


class EnvFault(Exception):
  """An environment call raised or timed out."""


class EnvTimeout(EnvFault):
  """An environment call took longer than the configured timeout."""


class _Closing(Exception):
  """The runner is closing: the episode is abandoned, not counted as a fault."""


class EnvRunner:
  """Thread pool that advances episodes through their environment."""

  def __init__(self, env, *, on_group_fn: Callable[[rollout_lib.Group], None],
               max_new_tokens: int, num_workers: int = 2, timeout_s: float = 0.0,
               vocab_size: int | None = None,
               on_scored_fn: Callable[[rollout_lib.Rollout], None] | None = None):
    """Args:
      env: an `env_api.Environment` (or `MultiTurnEnvironment`).
      on_group_fn: receives each group once all its rollouts are scored.
      max_new_tokens: completion budget of an episode (observations included).
      num_workers: concurrent environment calls (slow tools need many).
      timeout_s: per-call limit in seconds (0: none).
      vocab_size: observation ids must be below it (an id outside the
        embedding table would be silently clamped by the model's gather, so
        it is an environment fault instead); None: not checked.
      on_scored_fn: receives each rollout as soon as it is scored, before its
        group is complete (the orchestrator records it as a restart point,
        should a checkpoint come); None: nobody.
    """
    self._env = env
    self._multi_turn = env.multi_turn
    self._on_group_fn = on_group_fn
    self._max_new_tokens = max_new_tokens
    self._timeout_s = timeout_s
    self._vocab_size = vocab_size
    self._resume_fn: Callable[[episode_lib.Episode], None] | None = None
    self._on_scored_fn = on_scored_fn
    self._pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="env")
    self._lock = threading.Lock()
    self._closing = threading.Event()
    self._finished: dict[int, list[rollout_lib.Rollout]] = {}
    self._cancelled: set[int] = set()
    self.errors: collections.Counter[str] = collections.Counter()
    self.timeouts: collections.Counter[str] = collections.Counter()
    self.turns = 0  # observations handed back to the engine
    # Scored episodes by `environment/outcome`, as their `env_api.Score` said.
    self.outcomes: collections.Counter[str] = collections.Counter()
    self._failure: BaseException | None = None

  def connect(self, resume_fn: Callable[[episode_lib.Episode], None]) -> None:
    """Where continuing episodes go (the engine's `resume`, after the wiring
    records their restart point: `training/rollouts.py`)."""
    self._resume_fn = resume_fn

  def submit(self, episode: episode_lib.Episode) -> None:
    """Takes an episode whose segment ended (the engine's `on_segment_fn`)."""
    self._pool.submit(self._advance, episode).add_done_callback(self._check)

  def restore(self, scored, to_env) -> None:
    """Takes back a checkpoint's work (`open_work.RestoredGroup`): rollouts
    already scored wait for the rest of their group; episodes whose
    environment call was pending get it (again). Call after `connect`."""
    with self._lock:
      for rollout in scored:
        self._finished.setdefault(rollout.group_id, []).append(rollout)
    for episode in to_env:
      self.submit(episode)

  def cancel(self, group_ids) -> None:
    """Drops the given groups: their episodes are discarded when they come back."""
    with self._lock:
      self._cancelled.update(group_ids)
      for gid in group_ids:
        self._finished.pop(gid, None)

  def _check(self, future: concurrent.futures.Future) -> None:
    # A failure outside the environment's own calls (a bug, not an
    # environment fault) would lose the group and stall the batch it belongs
    # to: keep it for the learner, which raises it instead of waiting forever.
    if (not future.cancelled() and future.exception() is not None
        and not isinstance(future.exception(), _Closing)):
      with self._lock:
        self._failure = self._failure or future.exception()

  def raise_if_failed(self) -> None:
    with self._lock:
      if self._failure is not None:
        raise RuntimeError("environment worker failed") from self._failure

  @property
  def failed(self) -> bool:
    with self._lock:
      return self._failure is not None

  def metrics(self) -> dict:
    """Environment faults and turns so far, for the step records."""
    with self._lock:
      record = {"env_errors": int(sum(self.errors.values())),
                "env_timeouts": int(sum(self.timeouts.values())), "env_turns": self.turns}
      if self.outcomes:
        record["env_outcomes"] = dict(sorted(self.outcomes.items()))
      return record

  def state_dict(self) -> dict:
    """The counters a checkpoint carries (per environment)."""
    with self._lock:
      return {"errors": dict(self.errors), "timeouts": dict(self.timeouts), "turns": self.turns,
              "outcomes": dict(self.outcomes)}

  def load_state_dict(self, state: dict) -> None:
    with self._lock:
      self.errors.update(state["errors"])
      self.timeouts.update(state["timeouts"])
      self.turns = int(state["turns"])
      self.outcomes.update(state.get("outcomes", {}))  # (none in older checkpoints)

  # -- one episode ---------------------------------------------------------------

  def _advance(self, episode: episode_lib.Episode) -> None:
    if self._is_cancelled(episode.group_id):
      return
    prompt = episode.request.prompt
    room = episode.budget(self._max_new_tokens) - len(episode.completion_ids)
    if self._multi_turn and episode.last_stopped and room > 0:
      try:
        observation = self._call(self._env.step, prompt, list(episode.completion_ids),
                                 episode=episode, convert_fn=self._to_observation)
      except EnvFault:
        self._end(episode, "error")
        return
      if observation is not None:
        if len(observation) < room:  # the policy must still be able to sample a token
          episode.add_observation(observation)
          with self._lock:
            self.turns += 1
          self._resume_fn(episode)
          return
        self._end(episode, "length")  # the answer does not fit the completion budget
        return
    self._end(episode, "stop" if episode.last_stopped else "length")

  def _end(self, episode: episode_lib.Episode, finish_reason: str) -> None:
    if self._is_cancelled(episode.group_id):
      return  # do not spend a worker (or count a timeout) on discarded work
    score = env_api.Score(0.0)
    name = self._env.env_name_of(episode.request.prompt)
    if finish_reason != "error":
      try:
        score = self._call(self._env.score, episode.request.prompt,
                           list(episode.completion_ids), episode=episode,
                           convert_fn=env_api.to_score)
      except EnvFault:
        finish_reason = "error"
    if score.outcome:
      with self._lock:
        self.outcomes[f"{name}/{score.outcome}"] += 1
    rollout = episode.to_rollout(finish_reason=finish_reason, reward=score.reward,
                                 env_name=name, reward_parts=score.parts, outcome=score.outcome)
    if self._on_scored_fn is not None:
      self._on_scored_fn(rollout)
    request = episode.request
    with self._lock:
      if episode.group_id in self._cancelled:
        return
      group = self._finished.setdefault(episode.group_id, [])
      group.append(rollout)
      if len(group) < request.group_size:
        return
      del self._finished[episode.group_id]
    group.sort(key=lambda r: r.sample_index)
    self._on_group_fn(rollout_lib.Group(
        group_id=request.group_id, prompt_id=request.prompt.prompt_id,
        dispatch_version=request.dispatch_version, rollouts=group))

  def _is_cancelled(self, group_id: int) -> bool:
    with self._lock:
      return group_id in self._cancelled

  def _call(self, fn, *args, episode: episode_lib.Episode, convert_fn):
    """Calls an environment method and checks its answer with `convert_fn`;
    raises EnvFault on an exception, a timeout or a malformed answer."""
    start = time.monotonic()
    name = self._env.env_name_of(episode.request.prompt)  # counted per environment
    try:
      if self._timeout_s > 0:
        return convert_fn(self._call_with_timeout(fn, args, name))
      return convert_fn(fn(*args))
    except (EnvFault, _Closing):
      raise
    except Exception as e:  # noqa: BLE001 - an environment fault is data, not a crash
      with self._lock:
        self.errors[name] += 1
      raise EnvFault(f"{name}.{fn.__name__} raised {e!r}") from e
    finally:
      episode.timings["in_env"] += time.monotonic() - start

  def _call_with_timeout(self, fn, args, name: str):
    box = {}

    def target():
      try:
        box["value"] = fn(*args)
      except BaseException as e:  # noqa: BLE001 - re-raised on the worker below
        box["error"] = e

    thread = threading.Thread(target=target, name=f"env-call-{name}", daemon=True)
    thread.start()
    deadline = time.monotonic() + self._timeout_s
    # Join in short slices so that `close` does not wait for a slow tool.
    while thread.is_alive() and time.monotonic() < deadline and not self._closing.is_set():
      thread.join(min(0.05, max(deadline - time.monotonic(), 0.0)))
    if thread.is_alive() and self._closing.is_set():
      raise _Closing()
    if thread.is_alive():
      with self._lock:
        self.errors[name] += 1
        self.timeouts[name] += 1
      raise EnvTimeout(f"{name}.{fn.__name__} took longer than {self._timeout_s}s")
    if "error" in box:
      raise box["error"]
    return box["value"]

  def _to_observation(self, value) -> list[int] | None:
    if value is None:
      return None
    tokens = [operator.index(t) for t in value]  # ints only (no floats, no strings)
    bad = [t for t in tokens if t < 0 or (self._vocab_size is not None and t >= self._vocab_size)]
    if bad:
      raise ValueError(f"observation token ids {bad} are outside the vocabulary "
                       f"[0, {self._vocab_size})")
    return tokens

  def close(self) -> None:
    self._closing.set()
    self._pool.shutdown(wait=True, cancel_futures=True)

