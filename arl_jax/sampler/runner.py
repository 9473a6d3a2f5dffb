"""`Runner`: executes the scheduler's plans (`plans.py`) through the slot
functions (`slot_fns.py`) and reports what the device produced.

It owns the device side of the engine: the `sampling.SlotState` (`state`),
the compiled slot functions (`fns`) and the base PRNG key every segment's
key derives from. It writes no host state: rows travel in the plans only so
that it can pack their episodes (`insert_batch.py`).

A prefill or a decode returns the `[B]` done flags as a device array, without
waiting for the work (dispatch is asynchronous): the scheduler does its
bookkeeping while the device computes and reads the flags last (one small
host read, which waits, so the work's time is billed to it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from arl_jax.sampler import engine_config, insert_batch, plans, slot_fns


class Runner:
  """Args:
    cfg: the engine's settings.
    fns: the slot functions.
    base_key: the PRNG key every segment's key derives from (in the insert program).
    pad_id: the padding token.
    stop_mask_fn: request -> its `[S]` stop-token mask (`insert_batch.request_stop_mask`).
  """

  def __init__(self, cfg: engine_config.EngineConfig, fns: slot_fns.SamplerFns, *, base_key,
               pad_id: int, stop_mask_fn):
    self.cfg = cfg
    self.fns = fns
    self.base_key = base_key
    self._pad_id = pad_id
    self._stop_mask = stop_mask_fn
    self.state = None  # the device's SlotState, from `init`
    self._no_rows = self._all_rows = None  # `[B]` bool on the device: no slot, every slot
    self._scalars: dict[int, jax.Array] = {}  # version -> its int32 scalar on the device

  def init(self) -> None:
    """Allocates the slots (every one empty and done)."""
    self.state = self.fns.init()
    self._no_rows = self._rows(np.zeros((self.cfg.num_slots,), bool))
    self._all_rows = self._rows(np.ones((self.cfg.num_slots,), bool))

  def _rows(self, mask: np.ndarray):
    return jax.device_put(mask, self.fns.row_sharding)

  def _version(self, version: int):
    if version not in self._scalars:
      if len(self._scalars) > 8:  # (old versions are not decoded again)
        self._scalars.clear()
      self._scalars[version] = jnp.int32(version)
    return self._scalars[version]

  def _set_pages(self, table) -> None:
    if table is not None:
      self.state = self.fns.set_pages(self.state, table)

  # -- plans ---------------------------------------------------------------------

  def prefill(self, plan: plans.PrefillPlan):
    """Runs a `PrefillPlan`; returns the `[B]` done flags after it (on the device)."""
    self._set_pages(plan.page_table)
    cfg = self.cfg
    for work in plan.work:
      if isinstance(work, plans.Insert):
        batch = insert_batch.pack(
            [(slot, row.episode) for slot, row in work.items], bucket=work.bucket,
            num_slots=cfg.insert_rows, max_new_tokens=cfg.max_new_tokens, pad_id=self._pad_id,
            stop_mask_fn=self._stop_mask)
        self.state = self.fns.insert_from_ids(work.params, self._version(work.version),
                                              self.state, self.base_key, *batch.args())
      elif isinstance(work, plans.BeginChunks):
        batch = insert_batch.pack_begin(
            [(slot, start, row.episode) for slot, start, row in work.items], length=cfg.length,
            num_slots=cfg.num_slots, max_new_tokens=cfg.max_new_tokens, pad_id=self._pad_id,
            stop_mask_fn=self._stop_mask)
        self.state = self.fns.begin_prefill(self.state, self.base_key, *batch.args())
      elif isinstance(work, plans.Fork):
        batch = insert_batch.pack_fork(
            [(slot, source, row.episode) for slot, source, row in work.items],
            num_slots=cfg.num_slots, max_new_tokens=cfg.max_new_tokens,
            stop_mask_fn=self._stop_mask)
        self.state = self.fns.fork(self.state, self.base_key, *batch.args())
      else:
        args, kwargs = cfg.attention_args(work.span)
        self.state = self.fns.prefill_chunk(
            work.params, self._version(work.version), self.state, work.rows, work.starts,
            work.final, *args, chunk=cfg.chunk_columns, **kwargs)
    return self.state.done

  def decode(self, plan: plans.DecodePlan) -> tuple[object, list[tuple]]:
    """Runs a `DecodePlan`; returns the `[B]` done flags after it (on the
    device) and the preempted slots' segments (read before anything else)."""
    preempted = self.read_segments(list(plan.preempted)) if plan.preempted else []
    self._set_pages(plan.page_table)
    stop = self._no_rows if plan.stop is None else self._rows(plan.stop)
    for i, call in enumerate(plan.calls):  # the first call ends the stopped slots
      version = self._version(call.version)
      if call.slots is None:
        mask = self._all_rows if call.mask is None else self._rows(call.mask)
        self.state = self.fns.decode(call.params, version, self.state,
                                     stop if i == 0 else self._no_rows, mask, steps=plan.steps)
      else:
        args, kwargs = self.cfg.attention_args(call.span)
        self.state = self.fns.decode_rows(call.params, version, self.state,
                                          stop if i == 0 else self._no_rows, call.slots, *args,
                                          steps=plan.steps, **kwargs)
    return self.state.done, preempted

  def recompute(self, plan: plans.Recompute) -> None:
    """Prefills the occupied slots' keys and values again under new params;
    returns when done (a swap's pause is its real time)."""
    self.state = self.fns.recompute(plan.params, self.state, self._rows(plan.occupied),
                                    width=plan.width)
    jax.block_until_ready(self.state.cache.valid)

  # -- reads ---------------------------------------------------------------------

  def read_segments(self, slots: list[int]) -> list[slot_fns.Segment]:
    """Each slot's segment (`slot_fns.read_segments`)."""
    return slot_fns.read_segments(self.fns, self.state, slots)

  def open_segments(self, slots: list, waiting) -> dict:
    """Every segment under way, read from `slots` and held by `waiting`
    (`slot_fns.open_segments`)."""
    return slot_fns.open_segments(self.fns, self.state, slots, waiting)
