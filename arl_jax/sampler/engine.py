"""The sampler engine: a thread that turns group requests into rollouts.

Continuous batching: `num_slots` rows share one preallocated KV cache. When a
slot finishes (EOS, length limit, cancellation) it is refilled with the next
waiting request (`sampling.insert`) while the other slots keep decoding, so a
long completion never holds a batch. Prompts are left-padded to the smallest
configured prompt bucket and inserts are padded to a power-of-two row count,
so nothing recompiles in steady state.

Weight updates (`weight_update`), checked between two decode steps:

- `in_flight`: swap to the newest published params; active slots continue.
  KV policy `keep` leaves their cache as computed; `recompute` re-prefills it
  under the new params. Later tokens record the new version either way.
- `pinned`: every slot finishes on the version it started with; the engine
  holds each version still referenced (at most K + 1, since older groups are
  cancelled) and decodes each version's slots with its own params.
- `drain`: once a newer version is published, admit nothing new, let the
  active slots finish, then swap.

Multi-turn episodes (`multi_turn`): when a segment ends, the episode leaves its
slot and goes to `on_segment_fn`; an environment may append observation tokens
and hand it back with `resume`. It then waits for a slot like a new request
(ahead of them) and is re-admitted by prefilling its whole context under the
params live at that moment. Contexts are padded to `continuation_buckets`, and
each slot has `context_bucket` spare columns so that the rounding never eats
into the completion budget (`max_new_tokens` counts every completion token,
observations included: a rollout always fits its TrainBatch row).

Cancelled groups lose their waiting rows, their slots and any later resume at once.

Checkpoints (`paused`, `open_segments`, `restore`): the learner holds the
engine between two decode steps, reads the tokens each occupied slot has
sampled so far and, at the same instant, the dispatcher's open work; a resumed
run re-admits those episodes with their open segments in the context, and the
segments go on where they stopped.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arl_jax import episode as episode_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.sampler import param_swap, sampling

WEIGHT_UPDATE_MODES = ("in_flight", "pinned", "drain")
KV_POLICIES = ("keep", "recompute")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Attributes:
    num_slots: rows decoded together (>= the group size, a multiple of the
      sampler mesh's data axis).
    group_size: G, rollouts per group.
    prompt_buckets: ascending prompt lengths prompts are padded to; the
      largest is the longest prompt accepted.
    max_new_tokens: N, completion budget.
    weight_update: one of WEIGHT_UPDATE_MODES.
    kv_policy: one of KV_POLICIES (used by `in_flight`).
    seed: base of the per-rollout PRNG keys.
    multi_turn: episodes may be resumed after an environment turn.
    context_bucket: granularity of re-admitted context lengths (contexts
      longer than the longest prompt: multi-turn episodes, and segments a
      checkpoint left open; capped at `max_new_tokens`, see `context_step`).
  """

  num_slots: int
  group_size: int
  prompt_buckets: tuple[int, ...]
  max_new_tokens: int
  weight_update: str = "in_flight"
  kv_policy: str = "keep"
  seed: int = 0
  multi_turn: bool = False
  context_bucket: int = 16

  def __post_init__(self):
    if self.weight_update not in WEIGHT_UPDATE_MODES:
      raise ValueError(f"weight_update must be one of {WEIGHT_UPDATE_MODES}, "
                       f"got {self.weight_update!r}")
    if self.kv_policy not in KV_POLICIES:
      raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {self.kv_policy!r}")
    if not self.prompt_buckets or list(self.prompt_buckets) != sorted(set(self.prompt_buckets)):
      raise ValueError(f"prompt_buckets must be ascending and distinct, got {self.prompt_buckets}")
    if self.context_bucket < 1:
      raise ValueError(f"context_bucket must be >= 1, got {self.context_bucket}")

  @property
  def prompt_len(self) -> int:
    """The longest prompt accepted (the largest bucket)."""
    return self.prompt_buckets[-1]

  @property
  def context_step(self) -> int:
    """Granularity of continuation buckets: `context_bucket`, but no more than
    the budget (a short single-turn budget should not pay for 16 spare columns)."""
    return min(self.context_bucket, self.max_new_tokens)

  @property
  def length(self) -> int:
    """L: columns of a slot (longest prompt bucket + max new tokens, plus the
    spare columns that continuation buckets may round into)."""
    return self.prompt_buckets[-1] + self.max_new_tokens + self.context_step

  @property
  def continuation_buckets(self) -> tuple[int, ...]:
    """Lengths a re-admitted context is padded to: the prompt buckets, then
    multiples of `context_step` up to the longest context that can still
    sample a token (prompt_len + max_new_tokens - 1). A context padded to its
    bucket leaves room for the rest of its budget: the bucket exceeds the
    context by less than `context_step`, the spare columns of `length`."""
    longest = self.prompt_len + self.max_new_tokens - 1
    g = self.context_step
    more = range((self.prompt_len // g + 1) * g, longest + g, g)
    return self.prompt_buckets + tuple(more)


@dataclasses.dataclass
class EngineStats:
  """Counters; seconds are wall time of the engine thread."""

  steps: int = 0
  inserts: int = 0
  resumes: int = 0  # re-admissions of multi-turn episodes (counted in inserts too)
  swaps: int = 0
  sampled_tokens: int = 0
  finished_segments: int = 0
  cancelled_rollouts: int = 0
  # Of cancelled rollouts: completion budget left unsampled (the compute
  # cancellation saved, an upper bound: a rollout may have stopped earlier),
  # and tokens already sampled (work thrown away).
  cancelled_tokens: int = 0
  cancelled_sampled_tokens: int = 0
  decode_seconds: float = 0.0
  prefill_seconds: float = 0.0
  swap_seconds: float = 0.0
  queue_wait_seconds: float = 0.0
  occupied_slot_steps: int = 0
  model_passes: int = 0  # decode forwards; > steps when pinned serves several versions
  slot_steps: int = 0
  max_versions_held: int = 1

  @property
  def busy_seconds(self) -> float:
    return self.decode_seconds + self.prefill_seconds + self.swap_seconds

  @property
  def occupancy(self) -> float:
    """Mean fraction of slots holding a live sequence per decode step."""
    return self.occupied_slot_steps / max(self.slot_steps, 1)

  def metrics(self) -> dict:
    """The sampler's numbers in a step record (cumulative)."""
    return {
        # Upper bound: cancelled rollouts' unsampled budget (they might have stopped earlier).
        "cancelled_tokens_saved_max": self.cancelled_tokens,
        "cancelled_tokens_discarded": self.cancelled_sampled_tokens,
        "sampler_resumes": self.resumes,
        "sampler_busy_s": self.busy_seconds,
        "sampler_swaps": self.swaps,
        "sampler_occupancy": self.occupancy,
        "sampler_tokens_per_s": self.sampled_tokens / max(self.busy_seconds, 1e-9),
        "sampler_prefill_s": self.prefill_seconds,
        "sampler_decode_s": self.decode_seconds,
        "sampler_swap_pause_s": self.swap_seconds,
        "sampler_queue_wait_s": self.queue_wait_seconds / max(self.inserts, 1),
        "sampler_versions_held": self.max_versions_held,
    }

  # The counters a checkpoint carries (the rest describe this process's time).
  _CHECKPOINTED = ("cancelled_rollouts", "cancelled_tokens", "cancelled_sampled_tokens")

  def state_dict(self) -> dict:
    return {name: getattr(self, name) for name in self._CHECKPOINTED}

  def load_state_dict(self, state: dict) -> None:
    for name in self._CHECKPOINTED:
      setattr(self, name, int(state[name]))


@dataclasses.dataclass
class _Row:
  """An episode's segment waiting for, or occupying, a slot."""

  episode: episode_lib.Episode
  ready_time: float  # when it started waiting for a slot
  version: int = -1  # version the segment started on (pinned mode decodes it with that)
  start_time: float = 0.0
  budget: int = 0  # tokens this segment may sample
  sampled: int = 0  # tokens sampled so far (host estimate, for cancellation stats)

  @property
  def group_id(self) -> int:
    return self.episode.group_id


def _batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  data = "data" if "data" in mesh.axis_names else None
  return NamedSharding(mesh, P(data, *([None] * (ndim - 1))))


def _state_shardings(mesh: Mesh, abstract_state: sampling.SlotState):
  """Slots over the `data` axis; KV heads over `tp` (like the attention weights)."""
  tp = "tp" if "tp" in mesh.axis_names else None
  data = "data" if "data" in mesh.axis_names else None

  def spec(leaf):
    if leaf.ndim == 4:  # cache keys / values [B, K, S, Dh]
      return NamedSharding(mesh, P(data, tp, None, None))
    return _batch_sharding(mesh, leaf.ndim)

  return jax.tree.map(spec, abstract_state)


@dataclasses.dataclass(frozen=True)
class SamplerFns:
  """The jitted slot functions for one engine geometry (see `make_sampler_fns`)."""

  init: Callable
  insert: Callable
  decode: Callable
  recompute: Callable
  take_rows: Callable


def make_sampler_fns(*, graphdef, model_cfg, mesh: Mesh, settings: sampling.SamplingSettings,
                     num_slots: int, length: int) -> SamplerFns:
  """Jits the slot functions with params as an argument and one pinned layout.

  Every function returns the SlotState in the same sharding (else the first
  decode after an insert would see a different layout and compile again), and
  donates the state it consumes (the KV cache is updated in place).

  Returns:
    `init()`, `insert(params, version, state, slots, tokens, mask, keys, max_new,
    stop_mask, open_len, open_logprobs, open_versions)`,
    `decode(params, version, state, stop_rows, rows)`,
    `recompute(params, state, rows)` and `take_rows(state, slots)`.
  """
  init = functools.partial(sampling.init_slots, model_cfg, num_slots=num_slots, length=length,
                           pad_id=settings.pad_id, num_stop_ids=len(settings.stop_ids))
  shardings = _state_shardings(mesh, jax.eval_shape(init))
  insert = functools.partial(sampling.insert, graphdef, settings=settings)
  decode = functools.partial(sampling.decode_step, graphdef, settings=settings)
  recompute = functools.partial(sampling.recompute_cache, graphdef)

  def take_rows(state, slots):
    fields = ("tokens", "token_mask", "logprobs", "versions", "prompt_end", "stopped")
    return {name: getattr(state, name)[slots] for name in fields}

  return SamplerFns(
      init=jax.jit(init, out_shardings=shardings),
      insert=jax.jit(insert, out_shardings=shardings, donate_argnums=2),
      decode=jax.jit(decode, out_shardings=shardings, donate_argnums=2),
      recompute=jax.jit(recompute, out_shardings=shardings, donate_argnums=1),
      take_rows=jax.jit(take_rows),
  )


def row_bucket(n: int, limit: int) -> int:
  """Rows an insert of `n` is padded to: the smallest power of two >= n, capped
  at `limit` (so a handful of insert shapes cover every admission)."""
  return min(1 << max(n - 1, 0).bit_length(), limit)


class SamplerEngine:
  """Generates episode segments on the sampler mesh in its own thread."""

  def __init__(self, *, cfg: EngineConfig, settings: sampling.SamplingSettings, graphdef,
               model_cfg, mesh: Mesh, publisher, dispatcher: dispatcher_lib.Dispatcher,
               on_segment_fn: Callable[[episode_lib.Episode], None],
               stop_ids_fn: Callable[[object], tuple[int, ...]] | None = None):
    """Args:
      cfg: engine settings.
      settings: sampling settings (temperature, top-k/p, every stop token).
      graphdef: decoder graph definition.
      model_cfg: the decoder's ModelConfig (cache geometry).
      mesh: the sampler mesh.
      publisher: source of `(version, params)` (a WeightPublisher).
      dispatcher: source of group requests.
      on_segment_fn: called (on the engine thread) with each episode whose
        segment just ended, unless its group was cancelled; the episode then
        belongs to the callee, which may hand it back with `resume`.
      stop_ids_fn: prompt record -> the stop tokens (of `settings.stop_ids`)
        that end its segments; None: all of them, for every prompt.
    """
    if cfg.num_slots < cfg.group_size:
      raise ValueError(f"num_slots={cfg.num_slots} must be >= group_size={cfg.group_size}")
    self._cfg = cfg
    self._settings = settings
    self._mesh = mesh
    self._publisher = publisher
    self._dispatcher = dispatcher
    self._on_segment_fn = on_segment_fn
    self._stop_ids_fn = stop_ids_fn
    self._fns = make_sampler_fns(graphdef=graphdef, model_cfg=model_cfg, mesh=mesh,
                                 settings=settings, num_slots=cfg.num_slots, length=cfg.length)
    self._lock = threading.Lock()
    self._cancel_requests: set[int] = set()
    self._resumed: list[_Row] = []  # handed back by env workers, under _lock
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.stats = EngineStats()
    # Host mirror of the slots; the device SlotState is built at the first publish.
    self._state = None
    self._slots: list[_Row | None] = [None] * cfg.num_slots
    self._pending: collections.deque[_Row] = collections.deque()
    # Cancelled group ids: an episode of one may still come back from an env worker.
    self._cancelled: set[int] = set()
    self._stop_rows = np.zeros((cfg.num_slots,), bool)
    self._no_rows = None
    self._done = np.zeros((cfg.num_slots,), bool)
    self._params_by_version: dict[int, object] = {}
    self._all_rows = None
    self._version_scalar = None
    self.version: int | None = None  # newest version held
    self._checked_version: int | None = None
    self._draining = False
    # `paused`: the caller asks, the engine thread acknowledges between two
    # steps and waits for the release.
    self._pause_lock = threading.Lock()
    self._pause_requested = threading.Event()
    self._paused = threading.Event()
    self._release = threading.Event()

  # -- control ---------------------------------------------------------------

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="sampler-engine", daemon=True)
    self._thread.start()

  def stop(self, raise_errors: bool = True) -> None:
    self._stop.set()
    self._release.set()  # (a paused engine thread must see the stop)
    if self._thread is not None:
      self._thread.join()
    if raise_errors:
      self.raise_if_failed()

  def raise_if_failed(self) -> None:
    if self._error is not None:
      raise RuntimeError("sampler engine failed") from self._error

  @property
  def failed(self) -> bool:
    return self._error is not None

  def cancel(self, group_ids) -> None:
    """Cancels every sequence of the given groups (thread-safe; applied before the next step)."""
    with self._lock:
      self._cancel_requests.update(group_ids)

  def resume(self, episode: episode_lib.Episode) -> None:
    """Hands back an episode whose environment appended observation tokens
    (thread-safe); it samples its next segment under the weights live when
    it is re-admitted."""
    if not self._cfg.multi_turn:
      raise ValueError("resume() needs an engine configured with multi_turn=True")
    used, budget = episode.length, episode.budget(self._cfg.max_new_tokens)
    if used >= budget:
      raise ValueError(f"group {episode.group_id}: the episode has {used} completion tokens; "
                       f"nothing is left of its budget of {budget}")
    with self._lock:
      self._resumed.append(_Row(episode=episode, ready_time=time.monotonic()))

  def restore(self, episodes) -> None:
    """Queues the episodes a checkpoint left waiting for the sampler (fresh,
    between turns, or with an open segment) ahead of any new request; they are
    re-admitted under the weights live then. Call before `start`."""
    if self._thread is not None:
      raise RuntimeError("restore() must come before start()")
    for episode in episodes:
      self._check_request(episode.request)
      budget = episode.budget(self._cfg.max_new_tokens)
      if episode.length >= budget:
        raise ValueError(f"group {episode.group_id}: a restored episode holds {episode.length} "
                         f"completion tokens; nothing is left of its budget of {budget}")
      self._pending.append(_Row(episode=episode, ready_time=time.monotonic()))

  @contextlib.contextmanager
  def paused(self, timeout_s: float = 300.0):
    """Holds the engine thread between two decode steps for the duration of
    the `with` block: no slot advances and no group is taken meanwhile, so
    the caller sees one instant of the sampler (`open_segments`) and of the
    dispatcher's open work. Thread-safe; one caller at a time."""
    with self._pause_lock:
      running = self._thread is not None and self._thread.is_alive()
      if running:
        self._release.clear()
        self._pause_requested.set()
        deadline = time.monotonic() + timeout_s
        while not self._paused.wait(0.1):
          self.raise_if_failed()
          if not self._thread.is_alive() or time.monotonic() > deadline:
            self._pause_requested.clear()
            self._release.set()
            raise RuntimeError("the sampler engine did not pause for a checkpoint snapshot")
      try:
        yield
      finally:
        if running:
          self._pause_requested.clear()
          self._paused.clear()
          self._release.set()

  def open_segments(self) -> dict:
    """`{(group_id, sample_index): (tokens, logprobs, versions)}`: what each
    occupied slot has sampled of its current segment. Only while `paused` (or
    before `start` / after `stop`): it reads the engine thread's slots.
    Cancellations asked for so far are applied first, so a cancelled group's
    slots are not read and its counters are those of the snapshot."""
    if self._thread is not None and self._thread.is_alive() and not self._paused.is_set():
      raise RuntimeError("open_segments() reads the slots: hold the engine with paused()")
    self._apply_cancellations()
    occupied = [i for i, row in enumerate(self._slots) if row is not None]
    partials = {}
    if occupied and self._state is not None:
      for slot, (tokens, logprobs, versions, _) in zip(occupied, self._read_segments(occupied)):
        episode = self._slots[slot].episode
        partials[(episode.group_id, episode.sample_index)] = (tokens, logprobs, versions)
    return partials

  def metrics(self) -> dict:
    return self.stats.metrics()

  def state_dict(self) -> dict:
    return self.stats.state_dict()

  def load_state_dict(self, state: dict) -> None:
    self.stats.load_state_dict(state)

  @property
  def active_slots(self) -> int:
    return sum(row is not None for row in self._slots)

  # -- loop --------------------------------------------------------------------

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        self._serve_pause()
        # Cancel first: a swap must not re-prefill, nor keep params alive for,
        # sequences that are about to be cancelled.
        self._apply_cancellations()
        self._sync_version()
        if self.version is None:
          time.sleep(0.01)
          continue
        self._take_requests()
        self._admit()
        if self.active_slots:
          self._step()
          self._harvest()
    except BaseException as e:  # surfaced to the learner thread by raise_if_failed
      self._error = e

  def _serve_pause(self) -> None:
    if not self._pause_requested.is_set():  # the common case: one flag read per step
      return
    self._paused.set()
    self._release.wait()

  def _rows_array(self, mask: np.ndarray):
    return jax.device_put(mask, _batch_sharding(self._mesh, 1))

  # -- versions ----------------------------------------------------------------

  def _sync_version(self) -> None:
    version, params = self._publisher.latest()
    if version is None or version == self.version:
      return
    start = time.monotonic()
    if self._state is None:  # first publish: allocate the slots
      self._state = self._fns.init()
      self._no_rows = self._rows_array(np.zeros((self._cfg.num_slots,), bool))
      self._all_rows = self._rows_array(np.ones((self._cfg.num_slots,), bool))
    elif version != self._checked_version:  # checked once, even if a drain defers it
      param_swap.check_swap_compatible(self._params_by_version[self.version], params)
      self._checked_version = version
    mode = self._cfg.weight_update
    if mode == "drain" and self.active_slots and self.version is not None:
      # Admit nothing new; swap once the active slots have finished.
      self._draining = True
      return
    if mode == "pinned":
      self._params_by_version[version] = params
    else:
      self._params_by_version = {version: params}
    if self.version is not None:
      self.stats.swaps += 1
      if mode == "in_flight" and self._cfg.kv_policy == "recompute" and self.active_slots:
        occupied = np.array([row is not None for row in self._slots])
        self._state = self._fns.recompute(params, self._state, self._rows_array(occupied))
        jax.block_until_ready(self._state.cache.valid)  # so swap_seconds is the real pause
    self.version = version
    self._version_scalar = jnp.int32(version)
    self._draining = False
    self._forget_unused_versions()
    self.stats.swap_seconds += time.monotonic() - start

  def _forget_unused_versions(self) -> None:
    used = {row.version for row in self._slots if row is not None} | {self.version}
    self._params_by_version = {v: p for v, p in self._params_by_version.items() if v in used}
    self.stats.max_versions_held = max(self.stats.max_versions_held,
                                       len(self._params_by_version))

  # -- admission ---------------------------------------------------------------

  def _free_slots(self) -> list[int]:
    return [i for i, row in enumerate(self._slots) if row is None]

  def _take_resumed(self) -> None:
    """Queues resumed episodes ahead of new requests: they are older work,
    and finishing them first keeps their lag down."""
    with self._lock:
      resumed, self._resumed = self._resumed, []
    for row in reversed(resumed):
      if row.group_id in self._cancelled:
        self._count_cancelled(row)
      else:
        self._pending.appendleft(row)

  def _take_requests(self) -> None:
    self._take_resumed()
    if self._draining:
      return
    free = len(self._free_slots()) - len(self._pending)
    max_groups = max(free, 0) // self._cfg.group_size
    if max_groups == 0:
      return
    # Block briefly only when there is nothing to decode.
    idle = not self.active_slots and not self._pending
    requests = self._dispatcher.take(max_groups, self.version, timeout=0.05 if idle else 0.0)
    for req in requests:
      self._check_request(req)
      self._pending.extend(
          _Row(episode=episode_lib.Episode(request=req, sample_index=s),
               ready_time=req.dispatch_time)
          for s in range(req.group_size))

  def _check_request(self, req: dispatcher_lib.GroupRequest) -> None:
    if req.group_size != self._cfg.group_size:
      raise ValueError(f"group {req.group_id} has {req.group_size} rollouts; the engine was "
                       f"configured for groups of {self._cfg.group_size}")
    if not 0 < len(req.prompt_ids) <= self._cfg.prompt_len:
      raise ValueError(f"group {req.group_id}: prompt has {len(req.prompt_ids)} tokens; the "
                       f"sampler takes 1 to {self._cfg.prompt_len} (sampler.prompt_len)")

  def _admit(self) -> None:
    if self._draining or not self._pending:
      return
    free = self._free_slots()
    rows = [self._pending.popleft() for _ in range(min(len(free), len(self._pending)))]
    by_bucket = collections.defaultdict(list)
    buckets = self._cfg.continuation_buckets
    for slot, row in zip(free, rows):
      n = len(row.episode.prompt_ids) + row.episode.length
      bucket = next(b for b in buckets if b >= n)
      by_bucket[bucket].append((slot, row))
    for bucket, items in by_bucket.items():
      self._insert(bucket, items)

  def _insert(self, bucket: int, items: list[tuple[int, _Row]]) -> None:
    start = time.monotonic()
    r = row_bucket(len(items), self._cfg.num_slots)
    padded = items + [items[-1]] * (r - len(items))  # duplicates rewrite the same slot
    tokens = np.full((r, bucket), self._settings.pad_id, np.int32)
    mask = np.zeros((r, bucket), bool)
    # A segment left open by a checkpoint continues: its tokens end the context.
    open_len = np.zeros((r,), np.int32)
    open_logprobs = np.zeros((r, bucket), np.float32)
    open_versions = np.full((r, bucket), sampling.NO_VERSION, np.int32)
    for i, (_, row) in enumerate(padded):
      episode = row.episode
      ids = episode.context_ids()
      tokens[i, bucket - len(ids):] = ids
      mask[i, bucket - len(ids):] = True
      k = open_len[i] = len(episode.open_tokens)
      if k:
        open_logprobs[i, bucket - k:] = episode.open_logprobs
        open_versions[i, bucket - k:] = episode.open_versions
    slots = np.array([slot for slot, _ in padded], np.int32)
    episodes = [row.episode for _, row in padded]
    stop_mask = np.stack([self._stop_mask(e.request) for e in episodes])
    keys = sampling.row_keys(self._cfg.seed, [e.group_id for e in episodes],
                             [e.sample_index for e in episodes], [e.turns for e in episodes])
    # Every completion token counts against the budget, observations included.
    max_new = np.array([e.budget(self._cfg.max_new_tokens) - e.length for e in episodes],
                       np.int32)
    # The first tokens are sampled by this prefill under `self.version`; tell
    # the dispatcher before it runs, so that no publish in between can miss
    # them (under `oldest_token`, in-flight lag counts from the first token).
    for _, row in items:
      self._dispatcher.note_sampling(row.group_id, self.version)
    self._state = self._fns.insert(self._params_by_version[self.version],
                                   self._version_scalar, self._state, slots, tokens, mask,
                                   keys, max_new, stop_mask, open_len, open_logprobs,
                                   open_versions)
    # Wait for the prefill so that its time is not billed to the next decode
    # step (dispatch is asynchronous); inserts are rarer than decode steps.
    jax.block_until_ready(self._state.done)
    now = time.monotonic()
    for (slot, row), budget in zip(items, max_new):
      row.version, row.start_time, row.budget, row.sampled = self.version, now, int(budget), 1
      row.episode.timings["queued"] += now - row.ready_time
      self.stats.queue_wait_seconds += now - row.ready_time
      self.stats.resumes += row.episode.turns > 0
      # A cancelled occupant's pending stop must not end the new sequence.
      self._stop_rows[slot] = False
      self._slots[slot] = row
    self.stats.inserts += len(items)
    self.stats.prefill_seconds += time.monotonic() - start

  def _stop_mask(self, request: dispatcher_lib.GroupRequest) -> np.ndarray:
    """Which of `settings.stop_ids` end segments of `request`'s episodes."""
    if self._stop_ids_fn is None:
      return np.ones((len(self._settings.stop_ids),), bool)
    try:
      return sampling.stop_mask_row(self._settings, self._stop_ids_fn(request.prompt))
    except ValueError as e:
      raise ValueError(f"group {request.group_id}: {e}") from e

  # -- cancellation ------------------------------------------------------------

  def _count_cancelled(self, row: _Row) -> None:
    self.stats.cancelled_rollouts += 1
    budget = row.budget or (row.episode.budget(self._cfg.max_new_tokens) - row.episode.length)
    self.stats.cancelled_tokens += max(budget - row.sampled, 0)
    self.stats.cancelled_sampled_tokens += row.sampled

  def _apply_cancellations(self) -> None:
    with self._lock:
      cancelled, self._cancel_requests = self._cancel_requests, set()
    if not cancelled:
      return
    self._cancelled |= cancelled
    self._take_resumed()  # drops resumed episodes of cancelled groups
    kept = collections.deque()
    for row in self._pending:
      if row.group_id in cancelled:
        self._count_cancelled(row)
      else:
        kept.append(row)
    self._pending = kept
    for slot, row in enumerate(self._slots):
      if row is not None and row.group_id in cancelled:
        self._slots[slot] = None  # free at once; the next decode ends the sequence
        self._stop_rows[slot] = True
        self._count_cancelled(row)
    if self._state is not None:
      self._forget_unused_versions()

  # -- decoding ----------------------------------------------------------------

  def _step(self) -> None:
    start = time.monotonic()
    occupied = np.array([row is not None for row in self._slots])
    stop_rows = self._rows_array(self._stop_rows) if self._stop_rows.any() else self._no_rows
    if self._cfg.weight_update == "pinned":
      versions = sorted({row.version for row in self._slots if row is not None})
    else:
      versions = [self.version]
    for i, version in enumerate(versions):
      if len(versions) == 1:
        rows = self._all_rows
      else:
        rows = self._rows_array(np.array(
            [row is not None and row.version == version for row in self._slots]))
      version_scalar = self._version_scalar if version == self.version else jnp.int32(version)
      # Pinned mode runs one model pass per version held (counted below).
      self._state = self._fns.decode(self._params_by_version[version], version_scalar,
                                     self._state, stop_rows if i == 0 else self._no_rows, rows)
    self.stats.model_passes += len(versions)
    self._stop_rows[:] = False
    for row in self._slots:
      if row is not None:
        row.sampled += 1
    # One small host sync per step: which slots finished.
    self._done = np.asarray(self._state.done)
    self.stats.steps += 1
    self.stats.slot_steps += self._cfg.num_slots
    self.stats.occupied_slot_steps += int(occupied.sum())
    self.stats.decode_seconds += time.monotonic() - start

  def _harvest(self) -> None:
    finished = [i for i, row in enumerate(self._slots) if row is not None and self._done[i]]
    if not finished:
      return
    segments = self._read_segments(finished)
    now = time.monotonic()
    ended = []
    for slot, (tokens, logprobs, versions, stopped) in zip(finished, segments):
      row = self._slots[slot]
      self._slots[slot] = None
      restored = len(row.episode.open_tokens)  # sampled before a resume (counted then)
      row.episode.add_segment(tokens, logprobs, versions, stopped=stopped)
      row.episode.timings["generating"] += now - row.start_time
      self.stats.sampled_tokens += len(tokens) - restored
      self.stats.finished_segments += 1
      ended.append(row.episode)
    self._forget_unused_versions()
    # Handed over last: from here on the episodes belong to the callee.
    for episode in ended:
      self._dispatcher.work.at_env(episode)  # its restart point, should a checkpoint come
      self._on_segment_fn(episode)

  def _read_segments(self, slots: list[int]) -> list[tuple]:
    """`(tokens, logprobs, versions, stopped)` of each slot's current segment
    (from its first completion column, open tokens of a resume included)."""
    r = row_bucket(len(slots), self._cfg.num_slots)
    idx = np.array(slots + [slots[-1]] * (r - len(slots)), np.int32)
    host = jax.device_get(self._fns.take_rows(self._state, idx))
    segments = []
    for j in range(len(slots)):
      start = int(host["prompt_end"][j])
      cols = slice(start, start + int(host["token_mask"][j, start:].sum()))
      segments.append((host["tokens"][j, cols], host["logprobs"][j, cols],
                       host["versions"][j, cols], bool(host["stopped"][j])))
    return segments
