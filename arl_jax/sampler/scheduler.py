"""`Scheduler`: the sampler engine's host side, in plain Python (no JAX).

It alone writes the engine's host state: the slot table (`slot_table.py`),
the rows waiting for a slot (`waiting_rows.py`), the page pool
(`kv_slots.py`), the chunked prefills and the forks waiting on them
(`prefilling.py`), the weight-update policy's versions
(`weight_updates.py`), the cancellations asked for, and the counters
(`engine_stats.py`). Each engine iteration it plans the device's work
(`plans.py`); the runner (`runner.py`) executes a plan and reports what the
device produced (which slots are done, the segments it read); the scheduler
applies the report. The engine (`engine.py`) is the loop that joins them to
the request and weight sources.

The invariant it keeps: a slot holds a row <=> the slot's pages, its prefill
entry (if any) and the row agree; a freed slot holds no pages and is ended
on the device by the next decode call (`SlotTable.stop`) unless a plan
overwrites it first (a fork waiting for its prompt does not). Forks of
another group waiting on a cancelled row's prefill go back to the queue's
front. `check()` asserts it (randomized tests call it after every step).

Order within an iteration: cancellations, the live version, new requests,
then `plan_prefill` (within the prefill budget: a chunk of the chunked
prefills under way; admissions in queue order: inserts, chunked prefills
begun, forks), then `plan_decode`
(pages for every live slot's next writes, preempting the youngest while the
pool is short; one decode call per version, per span when paged), then
`harvest` of the slots whose segments ended.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from arl_jax.core import episode as episode_lib
from arl_jax.sampler import (
  admission,
  engine_config,
  engine_stats,
  kv_slots,
  plans,
  prefill_budget,
  prefilling,
  slot_table,
  sources,
  waiting_rows,
  weight_updates,
)


class Scheduler:
  """See the module docstring. `cancel` and `resume` are thread-safe; every
  other method belongs to the engine thread (or to the caller before the
  engine starts)."""

  def __init__(self, cfg: engine_config.EngineConfig, requests: sources.RequestSource,
               updates: weight_updates.WeightUpdatePolicy):
    self.cfg = cfg
    self._requests = requests
    self._updates = updates
    self.stats = engine_stats.EngineStats(kv_pages=max(cfg.pool_pages - 1, 0))  # usable
    self._table = slot_table.SlotTable(cfg.num_slots)
    self._waiting = waiting_rows.WaitingRows()
    self._kv = kv_slots.make(cfg)
    self._prefills = prefilling.ChunkedPrefills(cfg)
    self.version: int | None = None  # the live version
    self._lock = threading.Lock()
    self._cancel_requests: set[int] = set()  # under _lock
    self._preempted: list[tuple[int, waiting_rows.Row]] = []  # by the decode being planned
    self._decoding = np.zeros((cfg.num_slots,), bool)  # slots the planned decode advances
    self._chunked: list[int] = []  # slots whose prefill the planned chunks end
    self._live_since: float | None = None  # end of the last decode that left a slot live

  # -- read-only views ---------------------------------------------------------

  @property
  def rows(self) -> tuple[waiting_rows.Row | None, ...]:
    """The row in each slot (None: free)."""
    return tuple(self._table.rows)

  @property
  def waiting(self) -> list[waiting_rows.Row]:
    """The rows waiting for a slot, front first."""
    return list(self._waiting)

  @property
  def pages(self):
    """The `page_pool.PagePool` of a paged cache (None: dense)."""
    return getattr(self._kv, "pool", None)

  @property
  def active(self) -> int:
    """Slots holding a row (decoding, prefilling or waiting to fork)."""
    return self._table.active

  @property
  def pending_stops(self) -> np.ndarray:
    """`[B]` bool: slots the next decode ends on the device (their occupant left)."""
    return self._table.stop.copy()

  @property
  def idle(self) -> bool:
    """Nothing in a slot, nothing waiting, nothing handed back."""
    return not self._table.active and not self._waiting and not self._waiting.handed_back

  @property
  def prefilling(self) -> bool:
    return bool(self._prefills)

  @property
  def admission_paused(self) -> bool:
    return self._updates.admission_paused

  def params(self, version: int):
    return self._updates.params(version)

  def held_params(self) -> dict:  # `{version: params}` the slots may decode with now
    return self._updates.held()

  def open_slots(self) -> list[waiting_rows.Row | None]:
    """Each slot's row; None where none is on the device (free, or a fork awaiting its prompt)."""
    return [None if self._prefills.awaits_source(i) else row
            for i, row in enumerate(self._table.rows)]

  # -- work coming in ------------------------------------------------------------

  def cancel(self, group_ids) -> None:
    """Cancels every sequence of the given groups (thread-safe; applied by
    `apply_cancellations`, before the next plan)."""
    with self._lock:
      self._cancel_requests.update(group_ids)

  def resume(self, episode: episode_lib.Episode) -> None:
    """Queues an episode handed back between turns (thread-safe)."""
    self.cfg.check_budget_left(episode, "the episode")
    self._waiting.resume(waiting_rows.Row(episode=episode, ready_time=time.monotonic()))

  def restore(self, episode: episode_lib.Episode) -> None:
    """Queues an episode a checkpoint left waiting, behind those queued so far."""
    self.cfg.check_request(episode.request)
    self.cfg.check_budget_left(episode, "a restored episode")
    self._waiting.append(waiting_rows.Row(episode=episode, ready_time=time.monotonic()))

  def take_requests(self) -> None:
    """Queues the groups the free slots have room for (beyond the rows waiting)."""
    for row in self._waiting.take_resumed():  # (of cancelled groups)
      self.stats.count_cancelled(row, self.cfg.max_new_tokens)
    if not self._updates.admission_paused:
      # Block briefly only when there is nothing to decode.
      idle = not self._table.active and not self._waiting
      self._waiting.extend(admission.take_groups(
          self._requests, self.cfg, free=len(self._table.free()) - len(self._waiting),
          version=self.version, timeout=0.05 if idle else 0.0))

  def apply_cancellations(self) -> set[int]:
    """Drops the waiting rows and frees the slots of the groups cancelled so far
    (pages back at once, ended on the device by the next decode); returns their ids."""
    with self._lock:
      cancelled, self._cancel_requests = self._cancel_requests, set()
    if not cancelled:
      return cancelled
    for row in self._waiting.cancel(cancelled):
      self.stats.count_cancelled(row, self.cfg.max_new_tokens)
    requeued = []
    for slot, row in enumerate(self._table.rows):
      if row is not None and row.group_id in cancelled:
        for fork_slot, _, fork_row in self._free_slot(slot):  # forks waiting on its prefill
          if fork_row.group_id not in cancelled:  # (another group's, of the same prompt)
            self._free_slot(fork_slot)
            requeued.append(fork_row)
        self._table.stop[slot] = True
        self.stats.count_cancelled(row, self.cfg.max_new_tokens)
    self._requeue(requeued)
    self._forget_unused_versions()
    return cancelled

  # -- versions ------------------------------------------------------------------

  def publish(self, version: int, params) -> weight_updates.Swap:
    """Offers a published version to the weight-update policy."""
    return self._updates.on_publish(version, params, busy=self._table.active > 0)

  def plan_recompute(self, params) -> plans.Recompute:
    # (A fork waiting for its prompt has nothing on the device to recompute.)
    occupied = np.array([row is not None for row in self.open_slots()])
    return plans.Recompute(params=params, occupied=occupied, width=self._kv.width(self._table.rows))

  def went_live(self, version: int, seconds: float) -> None:
    """`version` decodes from now on (`seconds`: the swap's pause)."""
    self.stats.swaps += self.version is not None
    self.version = version
    self._forget_unused_versions()
    self.stats.swap_seconds += seconds

  def _forget_unused_versions(self) -> None:
    if self.version is None:
      return
    used = {row.version for row in self._table.rows if row is not None} | {self.version}
    held = self._updates.retain(used)
    self.stats.max_versions_held = max(self.stats.max_versions_held, held)

  # -- one iteration -----------------------------------------------------------------

  def iterate(self, runner) -> list[episode_lib.Episode]:
    """Takes new requests, has `runner` (`runner.Runner`, or any object with
    its `prefill`, `decode` and `read_segments`) run a prefill plan and a
    decode plan, and harvests: returns the episodes whose segments ended
    (they belong to the caller from here on). Call with a live version."""
    self.take_requests()
    plan = self.plan_prefill()
    if plan:
      self.prefilled(plan, runner.prefill(plan))
    if not self._table.active:
      return []
    decode = self.plan_decode()
    if decode is not None:
      self.decoded(decode, *runner.decode(decode))
    finished = self.finished()
    return self.harvest(finished, runner.read_segments(finished)) if finished else []

  # -- prefill -----------------------------------------------------------------------

  def plan_prefill(self) -> plans.PrefillPlan:
    """Plans what the prefill budget pays for (`prefill_budget.py`): a chunk
    of the chunked prefills under way, then admissions of waiting rows into
    the free slots (and the first chunk of those prefilled in chunks)."""
    start = time.monotonic()
    budget = prefill_budget.PrefillBudget(self.cfg.max_prefill_tokens)
    advancing, work = self._prefills.select(budget), []
    if not self._updates.admission_paused and self._waiting:
      work += self._admit(budget)
      advancing += [slot for item in work if isinstance(item, plans.BeginChunks)
                    for slot, *_ in item.items]
    # (Pages change at admission; those freed since go to the device with the next work.)
    page_table = self._page_table() if work else None
    self._chunked = []
    if advancing:
      version_of = lambda slot: self._updates.decode_versions(
          [self._table.rows[slot].version], self.version)[0]
      chunks, self._chunked, ready = self._prefills.step(advancing, version_of,
                                                         self._updates.params)
      work += chunks
      if ready:  # forks that waited for those prompts; their slots are occupied already
        work.append(plans.Fork(tuple(ready)))
        self._table.stop[[slot for slot, *_ in ready]] = False  # (overwritten now)
        self.stats.forked_rows += len(ready)
    self.stats.prefill_chunks = self._prefills.calls
    self.stats.prefill_tokens += budget.spent
    return plans.PrefillPlan(page_table=page_table, work=tuple(work), start=start)

  def _admit(self, budget: prefill_budget.PrefillBudget) -> list:
    free = self._table.free()
    admitted = admission.plan(free, self._waiting.pop(len(free)), self.cfg, self._kv, budget)
    self._waiting.push_front(admitted.waiting)
    # Before any first token is sampled (under `oldest_token`, in-flight lag
    # counts from it), so that no publish in between can miss it.
    for row in admitted.rows:
      self._requests.note_sampling(row.group_id, self.version)
    work, chunked = [], []
    for bucket, items in admitted.inserts.items():
      whole = []
      for slot, row in items:  # a context longer than a chunk is prefilled in chunks
        (chunked if self.cfg.chunked(len(row.episode.context_ids())) else whole).append(
            (slot, row))
      for start in range(0, len(whole), self.cfg.insert_rows):  # (temporaries grow with rows)
        work.append(plans.Insert(version=self.version,
                                 params=self._updates.params(self.version), bucket=bucket,
                                 items=tuple(whole[start:start + self.cfg.insert_rows])))
      self._occupy(whole, sampled=1, written=True)
    if chunked:
      work.append(plans.BeginChunks(tuple(self._prefills.begin(chunked))))
      self._occupy(chunked, sampled=0, written=True)
    forks = []
    for fork in admitted.forks:
      waits = self._prefills.prefilling(fork[1])  # starts when the prompt it forks from is whole
      if waits:
        self._prefills.wait(fork)
      else:
        forks.append(fork)
      self._occupy([(fork[0], fork[2])], sampled=0, written=not waits)
    if forks:
      work.append(plans.Fork(tuple(forks)))
      self.stats.forked_rows += len(forks)
    return work

  def _occupy(self, items, sampled: int, written: bool) -> None:
    """Puts admitted `(slot, row)` in their slots, `sampled` tokens sampled
    by their prefill (1: it samples the first; 0: a chunked prefill or a
    fork); `written`: the plan writes the slots on the device (a fork that
    waits for its prompt does not yet: a stop pending there must still end
    the slot's previous occupant)."""
    now = time.monotonic()
    for slot, row in items:
      row.version, row.start_time, row.sampled = self.version, now, sampled
      row.budget = row.episode.budget_left(self.cfg.max_new_tokens)
      row.first_column = len(row.episode.context_ids())
      row.episode.timings["queued"] += now - row.ready_time
      self.stats.queue_wait_seconds += now - row.ready_time
      self.stats.resumes += row.episode.turns > 0
      if written:
        self._table.stop[slot] = False  # (a cancelled occupant's pending stop: overwritten)
      self._table.rows[slot] = row
    self.stats.inserts += len(items)

  def prefilled(self, plan: plans.PrefillPlan, done) -> None:
    """Applies `plan`'s result: `done`, the `[B]` done flags
    after it (a first token may end a segment; read last: on the device it
    is the end of the work)."""
    for slot in self._chunked:
      self._table.rows[slot].sampled = 1
    self._chunked = []
    self._table.done = np.array(done, bool)
    self.stats.prefill_seconds += time.monotonic() - plan.start
    self.stats.prefill_phases += 1

  # -- decode ------------------------------------------------------------------------

  def plan_decode(self) -> plans.DecodePlan | None:
    """Pages for the live slots' next writes (preempting while short), and
    the decode calls; None when no slot decodes."""
    start = time.monotonic()
    rows = self._table.rows
    decoding = np.flatnonzero(self._table.occupied(self._prefills.held))
    if not len(decoding):  # (every occupied slot is prefilling)
      return None
    versions = self._updates.decode_versions((rows[s].version for s in decoding), self.version)
    steps = self._burst(versions)
    self._preempted = []
    self._kv.grow(rows, self._table.done, self._preempt, steps)
    page_table = self._page_table()
    held = self._prefills.held
    occupied = self._table.occupied(held)  # (growing may have preempted some)
    calls = []
    for version in versions:
      mine = occupied if len(versions) == 1 else occupied & np.array(
          [row is not None and row.version == version for row in rows])
      # A dense call may name every slot (None): free ones are done on the device.
      mask = None if len(versions) == 1 and not held else mine
      calls += [plans.DecodeCall(version=version, params=self._updates.params(version),
                                 mask=mask, slots=slots, span=span)
                for span, slots in self._kv.calls(rows, mine, steps)]
    # The first call ends the stopped slots; with no call (all preempted) they stay pending.
    stop = self._table.stop.copy() if calls and self._table.stop.any() else None
    if stop is not None:
      self._table.stop[:] = False
    self._decoding = occupied
    preempted = tuple(slot for slot, _ in self._preempted)
    return plans.DecodePlan(preempted=preempted, page_table=page_table, stop=stop,
                            calls=tuple(calls), steps=steps, start=start)

  def _burst(self, versions) -> int:
    """`decode_burst` steps unless rows, cancellations or versions wait: 1."""
    if self.cfg.decode_burst == 1 or self._waiting or self._prefills or len(versions) > 1:
      return 1
    with self._lock:
      return 1 if self._cancel_requests else self.cfg.decode_burst

  def decoded(self, plan: plans.DecodePlan, done, preempted_segments) -> None:
    """Applies a decode's result: the `[B]` done flags after it (read last:
    on the device they are the end of the work, which this bookkeeping
    overlaps), and the segments of `plan.preempted` (read before it)."""
    for (_, row), segment in zip(self._preempted, preempted_segments):
      self.stats.sampled_tokens += kv_slots.keep_open_segment(row.episode, segment)
      # (Its context now holds what it sampled: all of it is prefilled again.)
      self.stats.preempted_tokens += len(row.episode.context_ids())
    self._preempted = []
    occupied = self._decoding
    for slot in np.flatnonzero(occupied):
      self._table.rows[slot].sampled += plan.steps
    self.stats.model_passes += len(plan.calls)
    self._table.done = np.array(done, bool)
    self.stats.count_decode(plan.steps, self.cfg.num_slots, int(occupied.sum()), plan.start,
                            None if self._live_since is None else plan.start - self._live_since)
    # (The next call's wait counts from here if a slot still decodes.)
    self._live_since = time.monotonic() if (occupied & ~self._table.done).any() else None

  def _preempt(self, slot: int) -> None:
    """Evicts `slot` for lack of pages: the row waits first in line to be
    prefilled again (with the forks that waited for its prefill, if it had
    not ended); what it sampled of its segment becomes its episode's open
    segment once the runner has read it (`decoded`)."""
    row = self._table.rows[slot]
    if self._prefills.awaits_source(slot):  # (a waiting fork has nothing on the device)
      self.stats.preempted_tokens += len(row.episode.context_ids())
    else:  # (counted once its open segment is kept: `decoded`)
      self._preempted.append((slot, row))
    rows = [row]
    for fork_slot, *_, fork_row in self._free_slot(slot):  # forks waiting on its prefill
      self._free_slot(fork_slot)
      rows.append(fork_row)
    self._table.stop[slot] = True  # the next decode ends it on the device
    self._requeue(rows)
    self.stats.preemptions += 1

  def _requeue(self, rows) -> None:
    """Queues rows that left their slots (preempted, or forks whose prompt's
    prefill was cancelled) first in line, in their order."""
    now = time.monotonic()
    for r in rows:
      r.ready_time = now
      r.episode.timings["generating"] += now - r.start_time
    self._waiting.push_front(rows)

  # -- harvest -------------------------------------------------------------------------

  def finished(self) -> list[int]:
    """The slots whose segments ended (as of the last done flags), to read."""
    return self._table.finished(self._prefills.held)

  def harvest(self, slots: list[int], segments) -> list[episode_lib.Episode]:
    """Frees the finished `slots`, adding each one's segment (a
    `slot_fns.Segment` as the runner read it) to its episode; returns the
    episodes, which then belong to the caller."""
    now = time.monotonic()
    ended = []
    for slot, segment in zip(slots, segments):
      row = self._table.rows[slot]
      self._free_slot(slot)
      restored = len(row.episode.open_tokens)  # sampled before a resume (counted then)
      row.episode.add_segment(segment.tokens, segment.logprobs, segment.versions,
                              stopped=segment.stopped, alternatives=segment.alternatives)
      row.episode.timings["generating"] += now - row.start_time
      self.stats.sampled_tokens += len(segment.tokens) - restored
      self.stats.finished_segments += 1
      ended.append(row.episode)
    self._forget_unused_versions()
    return ended

  # -- slots and pages -------------------------------------------------------------------

  def _free_slot(self, slot: int) -> list:
    """Frees `slot`; returns the forks that waited on its prefill (to free too)."""
    self._table.rows[slot] = None
    self._kv.release(slot)
    return self._prefills.drop(slot)

  def _page_table(self):
    table = self._kv.page_table()
    self.stats.kv_pages_peak = self._kv.peak_pages
    return table

  def check(self) -> None:
    """Asserts the host state's invariants (see the module docstring)."""
    self._table.check(self._prefills.held, self.pages)
    if self.pages is not None:
      self.pages.check()
    holding = {id(row) for row in self._table.rows if row is not None}
    assert not holding & {id(row) for row in self._waiting}, "a row waits and holds a slot"
