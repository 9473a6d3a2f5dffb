"""The sampler engine: a thread that turns group requests into rollouts.

Continuous batching: `num_slots` rows share one KV cache; a slot that
finishes (EOS, length limit, cancellation) is refilled with the next waiting
request (`sampling.insert`) while the others keep decoding. Inserts come in a
few shapes (`insert_batch.py`), all compiled when the engine takes up its
first version with `precompile` (`precompile.py`), not mid-run.

Ports: requests come from a `sources.RequestSource`, weights from a
`sources.WeightSource`, and every episode whose segment ends goes to
`on_segment_fn`; the engine knows nothing else of the run around it.

Weight updates are checked between two decode steps; the engine's
`weight_updates.WeightUpdatePolicy` (`in_flight` with KV `keep` or
`recompute`, `pinned`, `drain`) says when a new version goes live, which
params decode which slots and whether admission waits.

Multi-turn episodes (`multi_turn`): when a segment ends, the episode leaves its
slot and goes to `on_segment_fn`; an environment may append observation tokens
and hand it back with `resume`, and it is re-admitted (ahead of new requests)
by prefilling its whole context, padded to `continuation_buckets`, under the
params live then (`engine_config.py`: the budget counts observations too).

Admission (`admitter.py`, `admission.py`) fills free slots in queue order;
the samples of a group share one prefill (`share_prompts`); contexts longer
than `prefill_chunk` are prefilled a chunk per loop iteration, between
decode steps (`prefilling.py`). Cancelled groups lose their waiting rows,
their slots and any later resume at once.

KV cache (`kv_cache`): dense, or paged (`kv_slots.py`: slots hold pages as
they grow; a full pool preempts the youngest, which resumes what it sampled).

Checkpoints (`paused`, `open_segments`, `restore`): the learner holds the
engine between two decode steps and reads each open segment with the
dispatcher's open work; a resumed run re-admits them, and they go on.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from arl_jax import episode as episode_lib
from arl_jax.sampler import (
  admitter,
  engine_config,
  engine_stats,
  insert_batch,
  kv_slots,
  param_swap,
  pause_gate,
  precompile,
  sampling,
  slot_fns,
  slot_table,
  sources,
  waiting_rows,
  weight_updates,
)


class SamplerEngine:
  """Generates episode segments on the sampler mesh in its own thread."""

  def __init__(self, *, cfg: engine_config.EngineConfig, settings: sampling.SamplingSettings,
               graphdef, model_cfg, mesh: Mesh, publisher: sources.WeightSource,
               dispatcher: sources.RequestSource,
               on_segment_fn: Callable[[episode_lib.Episode], None],
               stop_ids_fn: Callable[[object], tuple[int, ...]] | None = None,
               compile_progress_fn: Callable[[int, int, str], None] | None = None):
    """Args:
      cfg: engine settings.
      settings: sampling settings (temperature, top-k/p, every stop token).
      graphdef: decoder graph definition.
      model_cfg: the decoder's ModelConfig (cache geometry).
      mesh: the sampler mesh.
      publisher: source of `(version, params)`.
      dispatcher: source of group requests.
      on_segment_fn: called (on the engine thread) with each episode whose
        segment just ended, unless its group was cancelled; the episode then
        belongs to the callee, which may hand it back with `resume`.
      stop_ids_fn: prompt record -> the stop tokens (of `settings.stop_ids`)
        that end its segments; None: all of them, for every prompt.
      compile_progress_fn: `(done, total, label)` as `precompile` compiles
        each program (`precompile.compile_all`).
    """
    self._cfg = cfg
    self._settings = settings
    self._weights = publisher
    self._on_segment_fn = on_segment_fn
    self._compile_progress_fn = compile_progress_fn
    stop_mask_fn = functools.partial(insert_batch.request_stop_mask, settings, stop_ids_fn)
    self._fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=model_cfg, mesh=mesh,
                                          settings=settings, num_slots=cfg.num_slots,
                                          length=cfg.length, num_pages=cfg.pool_pages,
                                          page_size=cfg.page_size,
                                          paged_attention=cfg.paged_attention)
    self._kv = kv_slots.make(cfg)
    self._updates = weight_updates.make_policy(cfg.weight_update, cfg.kv_policy)
    # Every segment's PRNG key derives from it, in the insert program.
    self._base_key = np.asarray(jax.random.PRNGKey(cfg.seed))
    self._restored_lengths: list[int] = []  # context lengths `restore` queued
    self._lock = threading.Lock()
    self._cancel_requests: set[int] = set()  # under _lock
    self._stop = threading.Event()
    self._gate = pause_gate.PauseGate()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.stats = engine_stats.EngineStats(kv_pages=max(cfg.pool_pages - 1, 0))  # usable
    # Host mirror of the slots; the device SlotState is built at the first publish.
    self._state = None
    self._table = slot_table.SlotTable(cfg.num_slots)
    self._waiting = waiting_rows.WaitingRows()
    self._admitter = admitter.Admitter(
        cfg=cfg, fns=self._fns, requests=dispatcher, kv=self._kv, updates=self._updates,
        table=self._table, waiting=self._waiting, stats=self.stats, base_key=self._base_key,
        pad_id=settings.pad_id, stop_mask_fn=stop_mask_fn)
    self._prefills = self._admitter.prefills
    self._no_rows = self._all_rows = None  # `[B]` bool on the device: no slot, every slot
    self._version_scalar = None
    self.version: int | None = None  # the live version
    self._checked_version: int | None = None
    self._live_since: float | None = None  # end of the last decode call that left a slot live

  # -- control ---------------------------------------------------------------

  def start(self) -> None:
    if self._cfg.precompile:
      # A version published before the start is taken up on the caller's
      # thread: every compile is done before `start` returns, so the first
      # update does not wait on them and the RL clock (started after this)
      # times RL only. Without `precompile` shapes compile lazily anyway.
      self._sync_version()
    self._thread = threading.Thread(target=self._run, name="sampler-engine", daemon=True)
    self._thread.start()

  def stop(self, raise_errors: bool = True) -> None:
    self._stop.set()
    self._gate.open()  # (a paused engine thread must see the stop)
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
    self._cfg.check_budget_left(episode, "the episode")
    self._waiting.resume(waiting_rows.Row(episode=episode, ready_time=time.monotonic()))

  def restore(self, episodes) -> None:
    """Queues the episodes a checkpoint left waiting for the sampler (fresh,
    between turns, or with an open segment) ahead of any new request; they are
    re-admitted under the weights live then. Call before `start`."""
    if self._thread is not None:
      raise RuntimeError("restore() must come before start()")
    for episode in episodes:
      self._cfg.check_request(episode.request)
      self._cfg.check_budget_left(episode, "a restored episode")
      self._waiting.append(waiting_rows.Row(episode=episode, ready_time=time.monotonic()))
      self._restored_lengths.append(len(episode.context_ids()))

  def paused(self, timeout_s: float = 300.0):
    """Holds the engine thread between two decode steps for the duration of
    the `with` block: no slot advances and no group is taken meanwhile, so
    the caller sees one instant of the sampler (`open_segments`) and of the
    dispatcher's open work. Thread-safe; one caller at a time."""
    return self._gate.hold(self._thread, timeout_s=timeout_s, check_fn=self.raise_if_failed)

  def open_segments(self) -> dict:
    """`{(group_id, sample_index): (tokens, logprobs, versions)}` of every
    segment under way. Only while `paused` (or before `start` / after `stop`).
    Cancellations asked for so far are applied first, so a cancelled group's
    slots are not read and its counters are those of the snapshot."""
    if self._thread is not None and self._thread.is_alive() and not self._gate.is_paused:
      raise RuntimeError("open_segments() reads the slots: hold the engine with paused()")
    self._apply_cancellations()
    # (A fork waiting for its prompt has nothing on the device yet.)
    slots = [None if self._prefills.awaits_source(i) else row
             for i, row in enumerate(self._table.rows)]
    return slot_fns.open_segments(self._fns, self._state, slots, self._waiting)

  def metrics(self) -> dict:
    return self.stats.metrics()

  def state_dict(self) -> dict:
    return self.stats.state_dict()

  def load_state_dict(self, state: dict) -> None:
    self.stats.load_state_dict(state)

  def traces(self) -> dict[str, int]:
    """How many times each slot function compiled (`SamplerFns.traces`)."""
    return self._fns.traces()

  @property
  def active_slots(self) -> int:
    return self._table.active

  # -- loop --------------------------------------------------------------------

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        self._gate.serve()
        # Cancel first: a swap must not re-prefill, nor keep params alive for,
        # sequences that are about to be cancelled.
        self._apply_cancellations()
        self._sync_version()
        if self.version is None:
          time.sleep(0.01)
          continue
        self._admitter.take_requests(self.version)
        self._state = self._admitter.admit(self._state, self.version, self._version_scalar)
        if self._prefills:
          self._state = self._admitter.prefill(self._state, self.version, self._version_scalar)
        if self.active_slots:
          self._step()
          self._harvest()
    except BaseException as e:  # surfaced to the learner thread by raise_if_failed
      self._error = e

  def _rows_array(self, mask: np.ndarray):
    return jax.device_put(mask, self._fns.row_sharding)

  # -- versions ----------------------------------------------------------------

  def _sync_version(self) -> None:
    version, params = self._weights.latest()
    if version is None or version == self.version:
      return
    if self._state is None:  # first publish: allocate the slots
      self._state = self._fns.init()
      self._no_rows = self._rows_array(np.zeros((self._cfg.num_slots,), bool))
      self._all_rows = self._rows_array(np.ones((self._cfg.num_slots,), bool))
      if self._cfg.precompile:
        self._precompile(params)
    start = time.monotonic()  # (compiles are not a swap's pause)
    if self.version is not None and version != self._checked_version:
      # Checked once, even if a drain defers it.
      param_swap.check_swap_compatible(self._updates.params(self.version), params)
      self._checked_version = version
    swap = self._updates.on_publish(version, params, busy=self.active_slots > 0)
    if swap is weight_updates.Swap.DEFER:
      return
    if self.version is not None:
      self.stats.swaps += 1
      if swap is weight_updates.Swap.RECOMPUTE:
        occupied = np.array([row is not None for row in self._table.rows])
        self._state = self._fns.recompute(params, self._state, self._rows_array(occupied),
                                          width=self._kv.width(self._table.rows))
        jax.block_until_ready(self._state.cache.valid)  # so swap_seconds is the real pause
    self.version = version
    self._version_scalar = jnp.int32(version)
    self._forget_unused_versions()
    self.stats.swap_seconds += time.monotonic() - start

  def _precompile(self, params) -> None:
    """Compiles every shape of the slot functions (the params' layout is known now)."""
    shapes = precompile.engine_shapes(self._cfg, self._restored_lengths)
    self.stats.precompile_seconds = precompile.compile_all(
        self._fns, shapes, params=params, state=self._state, base_key=self._base_key,
        num_stop_ids=len(self._settings.stop_ids), progress_fn=self._compile_progress_fn)
    self.stats.precompiled_programs = shapes.num_programs

  def _forget_unused_versions(self) -> None:
    used = {row.version for row in self._table.rows if row is not None} | {self.version}
    held = self._updates.retain(used)
    self.stats.max_versions_held = max(self.stats.max_versions_held, held)

  # -- cancellation ------------------------------------------------------------

  def _apply_cancellations(self) -> None:
    with self._lock:
      cancelled, self._cancel_requests = self._cancel_requests, set()
    if not cancelled:
      return
    for row in self._waiting.cancel(cancelled):
      self.stats.count_cancelled(row, self._cfg.max_new_tokens)
    for slot, row in enumerate(self._table.rows):
      if row is not None and row.group_id in cancelled:
        self._free_slot(slot)  # at once; the next decode ends the sequence
        self._table.stop[slot] = True
        self.stats.count_cancelled(row, self._cfg.max_new_tokens)
    if self._state is not None:
      self._forget_unused_versions()

  # -- decoding ----------------------------------------------------------------

  def _step(self) -> None:
    start = time.monotonic()
    rows = self._table.rows
    decoding = np.flatnonzero(self._table.occupied(self._prefills.held))
    if not len(decoding):  # (every occupied slot is prefilling)
      return
    versions = self._updates.decode_versions((rows[s].version for s in decoding), self.version)
    steps = self._burst(versions)
    self._kv.grow(rows, self._table.done, self._preempt, steps)
    self._sync_pages()
    held = self._prefills.held
    occupied = self._table.occupied(held)  # (growing may have preempted some)
    stop_rows = self._rows_array(self._table.stop) if self._table.stop.any() else self._no_rows
    for i, version in enumerate(versions):
      mine = occupied if len(versions) == 1 else occupied & np.array(
          [row is not None and row.version == version for row in rows])
      version_scalar = self._version_scalar if version == self.version else jnp.int32(version)
      # One model pass per version (per width group, paged); the first ends cancelled slots.
      self._state, passes = self._kv.decode(
          self._fns, self._updates.params(version), version_scalar, self._state,
          stop_rows if i == 0 else self._no_rows, self._no_rows,
          self._all_rows if len(versions) == 1 and not held else self._rows_array(mine), mine,
          rows, steps)
      self.stats.model_passes += passes
    self._table.stop[:] = False
    for slot in np.flatnonzero(occupied):
      rows[slot].sampled += steps
    # One small host sync per call: which slots finished.
    self._table.read_done(self._state)
    self.stats.count_decode(steps, self._cfg.num_slots, int(occupied.sum()), start,
                            None if self._live_since is None else start - self._live_since)
    # (The next call's wait counts from here if a slot still decodes.)
    self._live_since = time.monotonic() if (occupied & ~self._table.done).any() else None

  def _burst(self, versions) -> int:
    """`decode_burst` steps unless rows, cancellations or versions wait: 1."""
    if self._cfg.decode_burst == 1 or self._waiting or self._prefills or len(versions) > 1:
      return 1
    with self._lock:
      return 1 if self._cancel_requests else self._cfg.decode_burst

  def _harvest(self) -> None:
    finished = self._table.finished(self._prefills.held)
    if not finished:
      return
    segments = slot_fns.read_segments(self._fns, self._state, finished)
    now = time.monotonic()
    ended = []
    for slot, (tokens, logprobs, versions, stopped) in zip(finished, segments):
      row = self._table.rows[slot]
      self._free_slot(slot)
      restored = len(row.episode.open_tokens)  # sampled before a resume (counted then)
      row.episode.add_segment(tokens, logprobs, versions, stopped=stopped)
      row.episode.timings["generating"] += now - row.start_time
      self.stats.sampled_tokens += len(tokens) - restored
      self.stats.finished_segments += 1
      ended.append(row.episode)
    self._forget_unused_versions()
    # Handed over last: from here on the episodes belong to the callee.
    for episode in ended:
      self._on_segment_fn(episode)

  # -- KV slots -------------------------------------------------------------------

  def _free_slot(self, slot: int) -> list:
    """Frees `slot`; returns the forks that waited on its prefill (to free too)."""
    self._table.rows[slot] = None
    self._kv.release(slot)
    return self._prefills.drop(slot)

  def _sync_pages(self) -> None:
    self._state = self._kv.sync(self._fns, self._state)
    self.stats.kv_pages_peak = self._kv.peak_pages

  def _preempt(self, slot: int) -> None:
    """Evicts `slot` for lack of pages: what it sampled of its segment stays
    with the episode, which waits first in line to be prefilled again (with
    the forks that waited for its prefill, if it had not ended)."""
    row = self._table.rows[slot]
    if not self._prefills.awaits_source(slot):  # (a waiting fork has nothing on the device)
      (tokens, logprobs, versions, _), = slot_fns.read_segments(self._fns, self._state, [slot])
      self.stats.sampled_tokens += kv_slots.keep_open_segment(row.episode, tokens, logprobs,
                                                              versions)
    rows = [row]
    for fork_slot, *_, fork_row in self._free_slot(slot):  # forks waiting on its prefill
      self._free_slot(fork_slot)
      rows.append(fork_row)
    now = time.monotonic()
    for r in rows:
      r.ready_time = now
      r.episode.timings["generating"] += now - r.start_time
    self._table.stop[slot] = True  # the next decode ends it on the device
    self._waiting.push_front(rows)
    self.stats.preemptions += 1
    self.stats.preempted_tokens += len(row.episode.context_ids())
