"""`AgentRunner`: a run's rollouts produced by OpenAI-client agents through its gateway.

The counterpart of `orchestrator/env_runner.py` for `agent.function`
(`agent_config.py`). A dispatch thread takes groups from the orchestrator's
dispatcher, as the sampler engine does for an environment; each of a group's
G rollouts is one call of the user's function on an event loop of its own
thread, with its own gateway session (`SessionStore.bind`). What the agent
sends is sampled by the run's engine like any other segment, so the
rollout's tokens, behaviour log-probs and versions are the session's latest
branch exactly (`sessions.py`; turns that could not extend it are counted as
breaks), and its reward is what the function returns (a number or an
`envs/env_api.Score` with parts and an outcome; else the reward the
agent POSTed to its session; else a fault).

Faults are data, as for environments: an exception, a call past
`timeout_s`, a reward that is not a finite number, or an agent that never
asked its base URL for anything makes the rollout `error` (reward 0,
counted per environment, never trained on). A cancelled group (it went
stale) stops at once: its sessions' open segments leave the engine, their
agents' tasks are cancelled, and any later request of theirs gets a 409.

Checkpoints: an agent's state is its own Python, which a checkpoint cannot
hold, so a resumed run keeps the group's finished rollouts and calls the
agent again for the rest (`restore`); nothing is trained twice or lost.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import inspect
import secrets
import threading
import time
from collections.abc import Callable

import numpy as np

from arl_jax.core import rollout as rollout_lib
from arl_jax.envs import env_api


class AgentRunner:
  """See the module docstring."""

  def __init__(self, agent_fn, *, gateway, root_url_fn: Callable[[], str], model: str,
               api_key: str = "", env=None, on_group_fn: Callable[[rollout_lib.Group], None],
               on_scored_fn: Callable[[rollout_lib.Rollout], None] | None = None,
               timeout_s: float = 0.0, max_concurrent: int = 0, optional_args=(),
               print_fn=None):
    """Args:
      agent_fn: the user's function (`agent_config.load_function`).
      gateway: the run's `Gateway` (its sessions and its engine's port).
      root_url_fn: the gateway's root, `http://HOST:PORT` (known once it serves).
      model: the served model's name.
      api_key: the gateway's key ("": none).
      env: the run's environment (prompt names; given to an agent that asks).
      on_group_fn: receives each group once its G rollouts are done.
      on_scored_fn: receives each rollout when done (its restart point).
      timeout_s: per agent call (0: none).
      max_concurrent: agent calls at once (0: no limit).
      optional_args: the optional keywords `agent_fn` declares.
      print_fn: where the first faults (then every 100th) are told, with
        their text (None: nowhere; they are counted either way).
    """
    self._fn, self._gateway, self._root_fn, self._model = agent_fn, gateway, root_url_fn, model
    self._api_key, self._env = api_key, env
    self._on_group_fn, self._on_scored_fn = on_group_fn, on_scored_fn
    self._timeout_s, self._optional = timeout_s, tuple(optional_args)
    self._print_fn = print_fn
    # (a class instance with an `async def __call__` counts as async)
    self._is_async = (inspect.iscoroutinefunction(agent_fn)
                      or inspect.iscoroutinefunction(type(agent_fn).__call__))
    self._lock = threading.Lock()
    self._finished: dict[int, list[rollout_lib.Rollout]] = {}
    self._tasks: dict[int, list[concurrent.futures.Future]] = collections.defaultdict(list)
    self._sessions: dict[int, set[str]] = collections.defaultdict(set)
    self._cancelled: set[int] = set()
    self.errors: collections.Counter[str] = collections.Counter()
    self.timeouts: collections.Counter[str] = collections.Counter()
    self.counts: collections.Counter[str] = collections.Counter()
    self._last_faults: collections.deque[str] = collections.deque(maxlen=8)
    self._failure: BaseException | None = None
    self._closing = threading.Event()
    self._loop = asyncio.new_event_loop()
    self._loop_thread = threading.Thread(target=self._loop.run_forever, name="agents",
                                         daemon=True)
    self._dispatch_thread: threading.Thread | None = None
    # Sync functions run on threads (a thread past its timeout is abandoned:
    # Python cannot kill it; its session is cancelled, so it soon stops).
    self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrent or 64,
                                                       thread_name_prefix="agent")
    self._slots = asyncio.Semaphore(max_concurrent) if max_concurrent else None
    self._http = None  # the shared `http_client` (made on first use)

  # -- lifecycle ---------------------------------------------------------------------

  def start(self, take_fn: Callable[[float], list]) -> None:
    """Starts calling agents for the groups `take_fn(timeout)` hands out."""
    self._loop_thread.start()
    self._dispatch_thread = threading.Thread(target=self._dispatch, args=(take_fn,),
                                             name="agent-dispatch", daemon=True)
    self._dispatch_thread.start()

  def _dispatch(self, take_fn) -> None:
    try:
      while not self._closing.is_set():
        for request in take_fn(0.1):
          self._start_group(request, range(request.group_size))
    except BaseException as e:  # noqa: BLE001 - kept for raise_if_failed
      with self._lock:
        self._failure = self._failure or e

  def restore(self, scored, to_run) -> None:
    """Takes back a checkpoint's work: rollouts already done wait for the rest
    of their group; the episodes not done (`to_run`) get their agent called
    again from the start. Call before `start`'s first group arrives."""
    with self._lock:
      for rollout in scored:
        self._finished.setdefault(rollout.group_id, []).append(rollout)
    by_group = collections.defaultdict(list)
    for episode in to_run:
      by_group[episode.group_id].append(episode)
    for episodes in by_group.values():
      self._start_group(episodes[0].request, [e.sample_index for e in episodes])

  def _start_group(self, request, indices) -> None:
    for index in indices:
      future = asyncio.run_coroutine_threadsafe(self._rollout(request, index), self._loop)
      future.add_done_callback(self._check)
      with self._lock:
        self._tasks[request.group_id].append(future)

  def cancel(self, group_ids) -> None:
    """Stops the given groups: their sessions are cancelled (open segments
    leave the engine; later requests get a 409) and their agents' tasks too."""
    group_ids = set(group_ids)
    with self._lock:
      self._cancelled.update(group_ids)
      tasks = [t for g in group_ids for t in self._tasks.pop(g, [])]
      sessions = [s for g in group_ids for s in self._sessions.pop(g, set())]
      for gid in group_ids:
        self._finished.pop(gid, None)
    for session_id in sessions:  # (kept, cancelled, until idle: a late request reads why)
      self._gateway.cancel_session(session_id, "its group was cancelled (too stale to train)")
    for task in tasks:
      task.cancel()
    with self._lock:
      self.counts["cancelled_rollouts"] += len(tasks)

  def close(self) -> None:
    self._closing.set()
    if self._dispatch_thread is not None:
      self._dispatch_thread.join(5)
    with self._lock:
      open_groups = list(self._tasks)
    self.cancel(open_groups)
    if self._loop_thread.is_alive():
      if self._http is not None and self._is_async:
        try:
          asyncio.run_coroutine_threadsafe(self._http.aclose(), self._loop).result(5)
        except Exception:  # noqa: BLE001 - closing; its connections go with the loop
          pass
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._loop_thread.join(5)
    if self._http is not None and not self._is_async:
      self._http.close()
    self._pool.shutdown(wait=False, cancel_futures=True)

  def _check(self, future: concurrent.futures.Future) -> None:
    # A failure outside the agent's own call (a bug here, not an agent
    # fault) would stall its group: keep it for the learner to raise.
    if not future.cancelled() and future.exception() is not None:
      with self._lock:
        self._failure = self._failure or future.exception()

  def raise_if_failed(self) -> None:
    with self._lock:
      if self._failure is not None:
        raise RuntimeError("the agent runner failed") from self._failure

  @property
  def failed(self) -> bool:
    with self._lock:
      return self._failure is not None

  # -- one rollout -------------------------------------------------------------------

  async def _rollout(self, request, index: int) -> None:
    if self._slots is not None:
      async with self._slots:
        await self._rollout_now(request, index)
    else:
      await self._rollout_now(request, index)

  async def _rollout_now(self, request, index: int) -> None:
    gid = request.group_id
    session_id = f"rollout-{gid}-{index}-{secrets.token_hex(8)}"  # (not guessable)
    with self._lock:
      if gid in self._cancelled:
        return
      self._sessions[gid].add(session_id)
      self.counts["agent_sessions"] += 1
    session = self._gateway.sessions.bind(session_id, (gid, index))
    name = self._env.env_name_of(request.prompt) if self._env is not None else "agent"
    kwargs = dict(base_url=f"{self._root_fn()}/sessions/{session_id}/v1", model=self._model,
                  prompt=request.prompt)
    extra = {"api_key": lambda: self._api_key or "none", "env": lambda: self._env,
             "http_client": self._http_client}
    kwargs.update({k: extra[k]() for k in self._optional})
    start = time.monotonic()
    fault, score = None, env_api.Score(0.0)
    try:
      result = await self._call(kwargs)
      reward = session.reward if result is None else result
      if reward is None:
        raise ValueError("the agent returned no reward and set none on its session")
      score = env_api.to_score(reward)  # (a number or an `env_api.Score`)
      if session.latest is None:
        raise ValueError("the agent made no request through its base URL")
    except asyncio.CancelledError:
      self._gateway.cancel_session(session_id, "its agent was cancelled")
      raise
    except TimeoutError:
      fault = "timeout"
      self._gateway.cancel_session(session_id, f"its agent took longer than {self._timeout_s} s "
                                   "(agent.timeout_s)")
    except Exception as e:  # noqa: BLE001 - an agent's fault is data, not a crash
      fault = repr(e)
    elapsed = time.monotonic() - start
    if fault is None:
      self._gateway.sessions.delete(session_id)  # (its tokens are the rollout's now)
    else:  # (an abandoned agent thread may go on asking: it reads why not)
      self._gateway.cancel_session(session_id, f"its agent failed: {fault[:200]}")
    with self._lock:
      self._sessions[gid].discard(session_id)
      if fault is not None:
        self.errors[name] += 1
        self.timeouts[name] += fault == "timeout"
        self._last_faults.append(f"{name}: {fault[:300]}")
        faults = sum(self.errors.values())
        if self._print_fn is not None and (faults <= 3 or faults % 100 == 0):
          self._print_fn(f"agent fault #{faults} (group {gid}, rollout {index}): {fault[:300]}")
      self.counts["agent_turns"] += session.turns
      self.counts["agent_session_breaks"] += session.breaks
    if fault is not None:
      score = env_api.Score(0.0)
    rollout = self._to_rollout(request, index, session, name, elapsed, score=score,
                               finish_reason="error" if fault else None)
    self._done(request, rollout)

  def _http_client(self):
    """One pooled client for every agent (async agents share the loop's
    `httpx.AsyncClient`; sync ones an `httpx.Client`, which is thread-safe).
    No timeout of its own: `timeout_s` bounds the whole call."""
    import httpx  # noqa: PLC0415 - the [serve] extra

    with self._lock:
      if self._http is None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        cls = httpx.AsyncClient if self._is_async else httpx.Client
        self._http = cls(timeout=httpx.Timeout(None), limits=limits)
      return self._http

  async def _call(self, kwargs):
    if self._is_async:
      call = self._fn(**kwargs)
    else:
      call = asyncio.get_running_loop().run_in_executor(self._pool, lambda: self._fn(**kwargs))
    if self._timeout_s > 0:
      return await asyncio.wait_for(call, self._timeout_s)
    return await call

  def _to_rollout(self, request, index: int, session, name: str, elapsed: float, *,
                  score: env_api.Score, finish_reason: str | None) -> rollout_lib.Rollout:
    """The session's latest branch as the group's rollout `index` (an agent
    that failed before any answer: its prompt alone, masked as an error)."""
    if session.latest is None:
      episode = None
      prompt_ids, arrays = request.prompt_ids, ([], [], [], [])
      timings = {"queued": 0.0, "generating": 0.0}
    else:
      episode = session.latest.episode
      prompt_ids = episode.prompt_ids
      arrays = (episode.completion_ids, episode.loss_mask, episode.logprobs, episode.versions)
      timings = {k: episode.timings.get(k, 0.0) for k in ("queued", "generating")}
    if finish_reason is None:
      finish_reason = "stop" if episode.last_stopped else "length"
    # The agent's own time (its tools, its thinking between turns) is `in_env`.
    timings["in_env"] = max(elapsed - timings["queued"] - timings["generating"], 0.0)
    return rollout_lib.Rollout(
        group_id=request.group_id, sample_index=index,
        prompt_ids=np.asarray(prompt_ids, np.int32),
        completion_ids=np.asarray(arrays[0], np.int32),
        loss_mask=np.asarray(arrays[1], np.float32),
        behaviour_logprobs=np.asarray(arrays[2], np.float32),
        token_versions=np.asarray(arrays[3], np.int32),
        dispatch_version=request.dispatch_version, finish_reason=finish_reason,
        reward=score.reward, env_name=name, timings=timings, reward_parts=dict(score.parts),
        outcome=score.outcome)

  def _done(self, request, rollout: rollout_lib.Rollout) -> None:
    gid = request.group_id
    with self._lock:
      if gid in self._cancelled:
        return
    if self._on_scored_fn is not None:
      self._on_scored_fn(rollout)
    with self._lock:
      if gid in self._cancelled:
        return
      group = self._finished.setdefault(gid, [])
      group.append(rollout)
      self.counts["agent_rollouts"] += 1
      if len(group) < request.group_size:
        return
      del self._finished[gid]
      self._tasks.pop(gid, None)
      self._sessions.pop(gid, None)
    group.sort(key=lambda r: r.sample_index)
    self._on_group_fn(rollout_lib.Group(
        group_id=gid, prompt_id=request.prompt.prompt_id,
        dispatch_version=request.dispatch_version, rollouts=group))

  # -- numbers -----------------------------------------------------------------------

  def metrics(self) -> dict:
    """Agent faults, sessions and turns so far, for the step records (the
    environment's names: `env_errors`, `env_timeouts`, `env_turns`)."""
    with self._lock:
      return {"env_errors": int(sum(self.errors.values())),
              "env_timeouts": int(sum(self.timeouts.values())),
              "env_turns": self.counts["agent_turns"],
              "agent_sessions": self.counts["agent_sessions"],
              "agent_rollouts": self.counts["agent_rollouts"],
              "agent_session_breaks": self.counts["agent_session_breaks"],
              "agent_cancelled_rollouts": self.counts["cancelled_rollouts"]}

  def last_faults(self) -> list[str]:
    """The last few agent faults, as text (for the log)."""
    with self._lock:
      return list(self._last_faults)

  def state_dict(self) -> dict:
    with self._lock:
      return {"errors": dict(self.errors), "timeouts": dict(self.timeouts),
              "counts": dict(self.counts)}

  def load_state_dict(self, state: dict) -> None:
    with self._lock:
      self.errors.update(state["errors"])
      self.timeouts.update(state["timeouts"])
      self.counts.update(state.get("counts", {}))
