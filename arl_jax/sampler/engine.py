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

The host side is a scheduler (`scheduler.py`, plain Python: the one writer
of the slot table, the waiting rows, the page pool, the chunked prefills and
the versions) whose plans a runner (`runner.py`) executes on the device;
this class is the loop between them and the sources (`iterate`).

Admission (`scheduler.py`, `admission.py`) fills free slots in queue order;
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
import numpy as np
from jax.sharding import Mesh

from arl_jax.core import episode as episode_lib
from arl_jax.core import schedule as schedule_lib
from arl_jax.sampler import (
  engine_config,
  engine_stats,
  insert_batch,
  param_swap,
  pause_gate,
  precompile,
  runner,
  sampling,
  schedule_tap,
  scheduler,
  slot_fns,
  sources,
  weight_updates,
)


class SamplerEngine:
  """Generates episode segments on the sampler mesh in its own thread."""

  def __init__(self, *, cfg: engine_config.EngineConfig, settings: sampling.SamplingSettings,
               graphdef, model_cfg, mesh: Mesh, publisher: sources.WeightSource,
               dispatcher: sources.RequestSource,
               on_segment_fn: Callable[[episode_lib.Episode], None],
               stop_ids_fn: Callable[[object], tuple[int, ...]] | None = None,
               compile_progress_fn: Callable[[int, int, str], None] | None = None,
               progress_sink: sources.ProgressSink | None = None,
               tap: schedule_tap.EngineTap | None = None):
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
      progress_sink: told the tokens of the segments it watches after every
        iteration (a gateway's streams); None: nobody.
      tap: records the engine's inputs, or replays recorded ones
        (`schedule_tap.py`); None: neither.
    """
    cfg.check_resolved()
    self._cfg = cfg
    self._settings = settings
    self._weights = publisher
    self._on_segment_fn = on_segment_fn
    self._compile_progress_fn = compile_progress_fn
    self._progress_sink = progress_sink
    fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=model_cfg, mesh=mesh,
                                    settings=settings, num_slots=cfg.num_slots,
                                    length=cfg.length, num_pages=cfg.pool_pages,
                                    page_size=cfg.page_size,
                                    paged_attention=cfg.paged_attention)
    self._tap = tap
    self.scheduler = scheduler.Scheduler(
        cfg, dispatcher if tap is None else tap.wrap(dispatcher),
        weight_updates.make_policy(cfg.weight_update, cfg.kv_policy))
    self.runner = runner.Runner(
        cfg, fns, base_key=np.asarray(jax.random.PRNGKey(cfg.seed)), pad_id=settings.pad_id,
        stop_mask_fn=functools.partial(insert_batch.request_stop_mask, settings, stop_ids_fn))
    self._restored_lengths: list[int] = []  # context lengths `restore` queued
    self._stop = threading.Event()
    if tap is not None:
      tap.attach(self._stop.is_set)
    self._gate = pause_gate.PauseGate()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self._checked_version: int | None = None
    # The precompiled program with the most temporaries: (label, bytes).
    self._largest_program: tuple[str, int] | None = None

  @property
  def stats(self) -> engine_stats.EngineStats:
    return self.scheduler.stats

  def declare_memory(self, ledger) -> None:
    """Tells a `memory_ledger.Ledger` what the engine holds: the params of
    the versions its slots decode with, and its slots' state (the KV cache)."""
    ledger.hold("sampler params", self, lambda e: e.scheduler.held_params())
    ledger.hold("sampler kv cache", self, lambda e: e.runner.state)

  @property
  def version(self) -> int | None:
    """The live version."""
    return self.scheduler.version

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
    """Cancels every sequence of the given groups (thread-safe; applied before
    the next step, or in a replay at the step the recorded run applied them)."""
    if self._tap is not None and self._tap.replaying:
      self._tap.request_cancel(group_ids)
    else:
      self.scheduler.cancel(group_ids)

  def resume(self, episode: episode_lib.Episode) -> None:
    """Hands back an episode whose environment appended observation tokens
    (thread-safe); it samples its next segment under the weights live when
    it is re-admitted."""
    if not self._cfg.multi_turn:
      raise ValueError("resume() needs an engine configured with multi_turn=True")
    self.scheduler.resume(episode)

  def restore(self, episodes) -> None:
    """Queues the episodes a checkpoint left waiting for the sampler (fresh,
    between turns, or with an open segment) ahead of any new request; they are
    re-admitted under the weights live then. Call before `start`."""
    if self._thread is not None:
      raise RuntimeError("restore() must come before start()")
    for episode in episodes:
      self.scheduler.restore(episode)
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
    return self.runner.open_segments(self.scheduler.open_slots(), self.scheduler.waiting)

  def metrics(self) -> dict:
    largest = self._largest_program  # (not a stat: a label; fleet stats are numbers)
    return self.stats.metrics() | ({} if largest is None else {
        "sampler_largest_program": largest[0],
        "sampler_largest_program_temporaries_bytes": largest[1]})

  def state_dict(self) -> dict:
    return self.stats.state_dict()

  def load_state_dict(self, state: dict) -> None:
    self.stats.load_state_dict(state)

  def traces(self) -> dict[str, int]:
    """How many times each slot function compiled (`SamplerFns.traces`)."""
    return self.runner.fns.traces()

  @property
  def active_slots(self) -> int:
    return self.scheduler.active

  # -- loop --------------------------------------------------------------------

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        if self._tap is None:
          self._gate.serve()
        else:
          self._tap.serve(self._gate)
        self.iterate()
    except schedule_lib.ReplayStop:  # (a replay waiting for what its stop ended)
      pass
    except BaseException as e:  # surfaced to the learner thread by raise_if_failed
      self._error = e

  def iterate(self) -> None:
    """One engine iteration: cancellations, the live version, new requests,
    a prefill plan and a decode plan run, finished segments handed over. The
    engine thread calls it in a loop; a synchronous driver may call it
    instead of `start` (one caller at a time)."""
    # Cancel first: a swap must not re-prefill, nor keep params alive for,
    # sequences that are about to be cancelled.
    self._apply_cancellations()
    self._sync_version()
    if self.version is None:
      time.sleep(0.01)
      return
    ended = self.scheduler.iterate(self.runner)
    if self._tap is not None:
      self._tap.n += 1
    self._report_progress()
    for episode in ended:
      self._on_segment_fn(episode)  # handed over last: from here on they belong to the callee

  def _apply_cancellations(self) -> None:
    """Applies the cancellations asked for (a replay: those the recorded run
    applied at this iteration, waiting for each to be asked)."""
    tap = self._tap
    if tap is None:
      self.scheduler.apply_cancellations()
    elif tap.replaying:
      for group_ids in tap.cancels_due():
        self.scheduler.cancel(group_ids)
        self.scheduler.apply_cancellations()
    else:
      tap.cancelled(self.scheduler.apply_cancellations())

  def _report_progress(self) -> None:
    """Tells the progress sink the segments it watches, as sampled so far."""
    watched = self._progress_sink.streaming_groups() if self._progress_sink else None
    if not watched:
      return
    rows = self.scheduler.open_slots()
    slots = [i for i, row in enumerate(rows) if row is not None and row.group_id in watched]
    if not slots:  # (queued, or ended this iteration: handed over with the whole segment)
      return
    for slot, segment in zip(slots, self.runner.read_segments(slots)):
      self._progress_sink.segment_progress(rows[slot].group_id, segment.tokens,
                                           segment.logprobs, segment.versions)

  # -- versions ----------------------------------------------------------------

  def _sync_version(self) -> None:
    expected = None
    if self._tap is not None and self._tap.replaying:
      due = self._tap.offer_due(self.version)
      if due is None:
        return
      version, expected = due
      params = self._tap.params(version)
    else:
      version, params = self._weights.latest()
      if version is None or version == self.version:
        return
    if self.runner.state is None:  # first publish: allocate the slots
      self.runner.init()
      if self._cfg.precompile:
        self._precompile(params)
    start = time.monotonic()  # (compiles are not a swap's pause)
    if self.version is not None and version != self._checked_version:
      # Checked once, even if a drain defers it.
      param_swap.check_swap_compatible(self.scheduler.params(self.version), params)
      self._checked_version = version
    swap = self.scheduler.publish(version, params)
    if self._tap is not None:
      self._tap.offered(version, swap.value, expected)
    if swap is weight_updates.Swap.DEFER:
      return
    if self.version is not None and swap is weight_updates.Swap.RECOMPUTE:
      self.runner.recompute(self.scheduler.plan_recompute(params))
    self.scheduler.went_live(version, time.monotonic() - start)

  def _precompile(self, params) -> None:
    """Compiles every shape of the slot functions (the params' layout is known now)."""
    shapes = precompile.engine_shapes(self._cfg, self._restored_lengths)
    compiled = precompile.compile_all(
        self.runner.fns, shapes, params=params, state=self.runner.state,
        base_key=self.runner.base_key, num_stop_ids=len(self._settings.stop_ids),
        progress_fn=self._compile_progress_fn)
    self.stats.precompile_seconds = compiled.seconds
    self.stats.precompiled_programs = shapes.num_programs
    self._largest_program = compiled.largest()
