"""`Admitter`: how the sampler engine brings waiting rows into its free slots.

It takes whole groups from the request source while slots are free
(`admission.take_groups`), plans each admission (`admission.plan`: which
rows are prefilled, which fork from another's prefill, which wait for KV
room), and runs the prefills: contexts that fit a chunk in one `insert`
call per bucket; longer ones a chunk per engine iteration
(`prefilling.ChunkedPrefills`, between decode steps); forks at once, or when
the prompt they fork from is whole. Every admitted row goes into the
engine's `slot_table.SlotTable` with the version it starts on.

Prefill calls wait for their result, so that their time is billed to
prefill and not to the next decode step (dispatch is asynchronous).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from arl_jax.sampler import (
  admission,
  engine_config,
  engine_stats,
  insert_batch,
  kv_slots,
  prefilling,
  slot_fns,
  slot_table,
  sources,
  waiting_rows,
  weight_updates,
)


class Admitter:
  """Fills the engine's free slots; its methods take the device state and
  return it updated (the engine thread's only)."""

  def __init__(self, *, cfg: engine_config.EngineConfig, fns: slot_fns.SamplerFns,
               requests: sources.RequestSource, kv: kv_slots.DenseSlots,
               updates: weight_updates.WeightUpdatePolicy, table: slot_table.SlotTable,
               waiting: waiting_rows.WaitingRows, stats: engine_stats.EngineStats, base_key,
               pad_id: int, stop_mask_fn: Callable):
    self._cfg = cfg
    self._fns = fns
    self._requests = requests
    self._kv = kv
    self._updates = updates
    self._table = table
    self._waiting = waiting
    self._stats = stats
    self._base_key = base_key
    self._pad_id = pad_id
    self._stop_mask = stop_mask_fn
    self.prefills = prefilling.ChunkedPrefills(cfg)

  def take_requests(self, version: int) -> None:
    """Queues the groups the free slots have room for (beyond the rows waiting)."""
    for row in self._waiting.take_resumed():  # (of cancelled groups)
      self._stats.count_cancelled(row, self._cfg.max_new_tokens)
    if not self._updates.admission_paused:
      # Block briefly only when there is nothing to decode.
      idle = not self._table.active and not self._waiting
      self._waiting.extend(admission.take_groups(
          self._requests, self._cfg, free=len(self._table.free()) - len(self._waiting),
          version=version, timeout=0.05 if idle else 0.0))

  def admit(self, state, version: int, version_scalar):
    """Admits waiting rows into the free slots and starts their prefills."""
    if self._updates.admission_paused or not self._waiting:
      return state
    free = self._table.free()
    admitted = admission.plan(free, self._waiting.pop(len(free)), self._cfg, self._kv)
    self._waiting.push_front(admitted.waiting)
    state = self._kv.sync(self._fns, state)
    # Before any first token is sampled (under `oldest_token`, in-flight lag
    # counts from it), so that no publish in between can miss it.
    for row in admitted.rows:
      self._requests.note_sampling(row.group_id, version)
    chunked = []
    for bucket, items in admitted.inserts.items():
      whole = []
      for slot, row in items:  # a context longer than a chunk is prefilled in chunks
        (chunked if self._cfg.chunked(len(row.episode.context_ids())) else whole).append(
            (slot, row))
      if whole:
        state = self._insert(state, version, version_scalar, bucket, whole)
    if chunked:
      state = self.prefills.begin(self._fns, state, self._base_key, chunked,
                                  pad_id=self._pad_id, stop_mask_fn=self._stop_mask)
      self._occupy(chunked, [self._budget(row) for _, row in chunked], 0, version,
                   time.monotonic())
    forks = []
    for fork in admitted.forks:
      if self.prefills.prefilling(fork[1]):  # starts when the prompt it forks from is whole
        self.prefills.wait(fork)
        self._occupy([(fork[0], fork[2])], [self._budget(fork[2])], 0, version,
                     time.monotonic())
      else:
        forks.append(fork)
    return self._fork(state, forks, version) if forks else state

  def prefill(self, state, version: int, version_scalar):
    """One chunk of every prefilling slot; those it completes sample their
    first token, and the forks waiting on them start."""
    start = time.monotonic()
    rows = self._table.rows
    version_of = lambda slot: self._updates.decode_versions([rows[slot].version], version)[0]
    params_of = lambda v: (self._updates.params(v),
                           version_scalar if v == version else jnp.int32(v))
    state, finished, forks = self.prefills.step(self._fns, state, version_of, params_of)
    self._table.read_done(state)  # (a first token may end a segment)
    for slot in finished:
      rows[slot].sampled = 1
    self._stats.prefill_chunks = self.prefills.calls
    self._stats.prefill_seconds += time.monotonic() - start
    return self._fork(state, forks, version, occupied=True) if forks else state

  def _budget(self, row: waiting_rows.Row) -> int:
    """Tokens `row`'s segment may sample."""
    return row.episode.budget_left(self._cfg.max_new_tokens)

  def _insert(self, state, version: int, version_scalar, bucket: int, items):
    """Prefills `(slot, row)` whose contexts share `bucket`, in one call."""
    start = time.monotonic()
    batch = insert_batch.pack(
        [(slot, row.episode) for slot, row in items], bucket=bucket,
        num_slots=self._cfg.num_slots, max_new_tokens=self._cfg.max_new_tokens,
        pad_id=self._pad_id, stop_mask_fn=self._stop_mask)
    state = self._fns.insert_from_ids(self._updates.params(version), version_scalar, state,
                                      self._base_key, *batch.args())
    self._table.read_done(state)  # (a first token may end a segment)
    self._occupy(items, batch.max_new, 1, version, start)
    return state

  def _fork(self, state, items, version: int, occupied: bool = False):
    """Starts forks `(slot, source, row)` from their sources' fresh
    prefills (their first tokens come with the next decode step);
    `occupied`: their slots were taken when the source's prefill began."""
    start = time.monotonic()
    batch = insert_batch.pack_fork(
        [(slot, source, row.episode) for slot, source, row in items],
        num_slots=self._cfg.num_slots, max_new_tokens=self._cfg.max_new_tokens,
        stop_mask_fn=self._stop_mask)
    state = self._fns.fork(state, self._base_key, *batch.args())
    jax.block_until_ready(state.done)
    if occupied:
      self._table.done[[slot for slot, *_ in items]] = False
      self._stats.prefill_seconds += time.monotonic() - start
    else:
      self._occupy([(slot, row) for slot, _, row in items], batch.max_new, 0, version, start)
    self._stats.forked_rows += len(items)
    return state

  def _occupy(self, items, budgets, sampled: int, version: int, start: float) -> None:
    """Puts admitted `(slot, row)` in their slots, `sampled` tokens sampled
    already (prefill begun at `start`)."""
    now = time.monotonic()
    for (slot, row), budget in zip(items, budgets):
      row.version, row.start_time, row.budget, row.sampled = version, now, int(budget), sampled
      row.first_column = len(row.episode.context_ids())
      row.episode.timings["queued"] += now - row.ready_time
      self._stats.queue_wait_seconds += now - row.ready_time
      self._stats.resumes += row.episode.turns > 0
      self._table.stop[slot] = False  # (a cancelled occupant's pending stop)
      self._table.done[slot] &= sampled > 0  # (a fork has sampled nothing: not done)
      self._table.rows[slot] = row
    self._stats.inserts += len(items)
    self._stats.prefill_seconds += now - start
