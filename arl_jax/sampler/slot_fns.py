"""The sampler's slot functions, jitted for one slot geometry and one mesh.

`sampling.py` holds the pure functions of the slot state; this module wires
them for a mesh: params are an argument (a newly published version is picked
up without recompiling), every function returns the state in one layout taken
from the sharding rules (`rules.SAMPLER_RULES` over `SlotState.logical_axes`),
and the state a function consumes is donated, so the KV cache is updated in
place. The engine, greedy evaluation and the tests' slot driver all run these.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from arl_jax.models import decode_kernels
from arl_jax.sampler import (
  engine_config,
  kv_recompute,
  paged_decode,
  prefill_chunks,
  sampling,
  segments,
  trace_counter,
)
from arl_jax.sharding import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class SamplerFns:
  """The jitted slot functions for one geometry (see `make_sampler_fns`).

  Attributes:
    init: `() -> SlotState`, every slot empty.
    insert: `(params, version, state, slots, tokens, mask, keys, max_new,
      stop_mask, open_len, open_logprobs, open_versions) -> SlotState`
      (`sampling.insert`).
    insert_from_ids: `(params, version, state, base_key, slots, tokens, mask,
      key_ids, max_new, stop_mask, open_len, open_logprobs, open_versions) ->
      SlotState`, `insert` with the keys derived in the program
      (`sampling.insert_from_ids`; the engine's admissions).
    fork: `(state, base_key, src, dst, key_ids, max_new, stop_mask) ->
      SlotState`, slots started on the prompt other slots were just given
      (`sampling.fork`; one program per row count).
    begin_prefill: `(state, base_key, slots, tokens, token_mask, logprobs,
      versions, key_ids, max_new, stop_mask, bucket, open_len, first) ->
      SlotState`, contexts put in slots to be prefilled in chunks
      (`prefill_chunks.begin`; one program per row count).
    prefill_chunk: `(params, version, state, rows, start, final, blocks=None,
      chunk, width, block=0) -> SlotState`, a chunk of those contexts
      prefilled (`prefill_chunks.prefill_chunk`; one program per row count
      and width, or per row count when it reads blocks).
    decode: `(params, version, state, stop_rows, rows, steps=1) -> SlotState`
      (`sampling.decode_step`; one program per step count).
    decode_rows: `(params, version, state, stop_rows, rows, blocks=None, width,
      steps=1, block=0) -> SlotState` (`paged_decode.decode_rows`, paged
      states; one program per row count, width and step count; `width`
      None, one per row count and step count).
    recompute: `(params, state, rows, width=None) -> SlotState`
      (`kv_recompute.recompute_cache`).
    set_pages: `(state, page_table) -> SlotState`, a paged cache's page table
      as the host's page pool holds it (`paged_decode.set_page_table`).
    take_rows: `(state, slots) -> dict` of the rows `slots` of the per-column
      fields and of `prompt_end` and `stopped` (what a harvest reads).
    state_shardings: the SlotState's NamedSharding per array.
    counters: a TraceCounter per function name (see `traces`).
  """

  init: Callable
  insert: Callable
  insert_from_ids: Callable
  fork: Callable
  begin_prefill: Callable
  prefill_chunk: Callable
  decode: Callable
  decode_rows: Callable
  recompute: Callable
  set_pages: Callable
  take_rows: Callable
  state_shardings: sampling.SlotState
  counters: Mapping[str, trace_counter.TraceCounter]

  @property
  def row_sharding(self) -> NamedSharding:
    """Where a `[B]` per-slot array (`stop_rows`, `rows`) lives: as the slots."""
    return self.state_shardings.done

  def traces(self) -> dict[str, int]:
    """How many times each function was traced, i.e. compiled (once per
    argument shape: insert once per prompt bucket and row count; `insert`
    and `insert_from_ids` count together as "insert")."""
    return {name: counter.count for name, counter in self.counters.items()}


def state_shardings(mesh: Mesh, abstract_state: sampling.SlotState) -> sampling.SlotState:
  """The slot state's layout on `mesh`, from `rules.SAMPLER_RULES`: slots over
  the `data` axis, KV heads over `tp`; axes the mesh lacks are replicated."""
  return rules_lib.array_shardings(abstract_state, abstract_state.logical_axes(), mesh,
                                   rules_lib.SAMPLER_RULES)


def _take_rows(state: sampling.SlotState, slots):
  fields = ("tokens", "token_mask", "logprobs", "versions", "prompt_end", "stopped")
  if state.top_ids.shape[-1]:  # (only a state that records alternatives moves them)
    fields += ("top_ids", "top_logprobs")
  return {name: getattr(state, name)[slots] for name in fields}


def make_sampler_fns(*, graphdef, model_cfg, mesh: Mesh, settings: sampling.SamplingSettings,
                     num_slots: int, length: int, num_pages: int = 0,
                     page_size: int = 0, paged_attention: str = "xla",
                     paged_layout: str | None = None) -> SamplerFns:
  """Jits the slot functions with params as an argument and one pinned layout.

  Every function returns the SlotState in the same sharding (else the first
  decode after an insert would see a different layout and compile again), and
  donates the state it consumes (the KV cache is updated in place).

  Args:
    graphdef: the decoder's graph definition.
    model_cfg: the decoder's ModelConfig (cache geometry).
    mesh: where the slots live.
    settings: sampling settings (static).
    num_slots: B, rows of the state.
    length: L, columns of a slot (and of its cache).
    num_pages: pages of a paged KV cache (0: a dense cache, `[B, L]` columns).
    page_size: columns per page of a paged cache.
    paged_attention: how a paged cache's decode steps attend
      (`models/paged_names.ATTENTIONS`).
    paged_layout: the paged pool's layout (None: the one `paged_attention`
      reads; the XLA path reads either, which is how tests run the TPU
      kernel's layout on CPU).
  """
  counters = {name: trace_counter.TraceCounter()
              for name in ("init", "insert", "fork", "prefill", "decode", "recompute",
                           "set_pages", "take_rows")}
  init = functools.partial(sampling.init_slots, model_cfg, num_slots=num_slots, length=length,
                           pad_id=settings.pad_id, num_stop_ids=len(settings.stop_ids),
                           num_pages=num_pages, page_size=page_size,
                           attention=paged_attention, layout=paged_layout,
                           top_logprobs=settings.top_logprobs,
                           # (a kernel XLA cannot partition runs per device on it)
                           mesh=mesh if decode_kernels.named(paged_attention).needs_mesh
                           else None)
  shardings = state_shardings(mesh, jax.eval_shape(init))
  insert = functools.partial(counters["insert"].wrap(sampling.insert), graphdef,
                             settings=settings)
  insert_from_ids = functools.partial(counters["insert"].wrap(sampling.insert_from_ids),
                                      graphdef, settings=settings)
  decode = functools.partial(counters["decode"].wrap(sampling.decode_step), graphdef,
                             settings=settings)
  decode_rows = functools.partial(counters["decode"].wrap(paged_decode.decode_rows),
                                  graphdef, settings=settings)
  prefill_chunk = functools.partial(counters["prefill"].wrap(prefill_chunks.prefill_chunk),
                                    graphdef, settings=settings)
  recompute = functools.partial(counters["recompute"].wrap(kv_recompute.recompute_cache), graphdef)
  return SamplerFns(
      init=jax.jit(counters["init"].wrap(init), out_shardings=shardings),
      insert=jax.jit(insert, out_shardings=shardings, donate_argnums=2),
      insert_from_ids=jax.jit(insert_from_ids, out_shardings=shardings, donate_argnums=2),
      fork=jax.jit(functools.partial(counters["fork"].wrap(sampling.fork), settings=settings),
                   out_shardings=shardings, donate_argnums=0),
      begin_prefill=jax.jit(counters["prefill"].wrap(prefill_chunks.begin),
                            out_shardings=shardings, donate_argnums=0),
      prefill_chunk=jax.jit(prefill_chunk, out_shardings=shardings, donate_argnums=2,
                            static_argnames=("chunk", "width", "block")),
      decode=jax.jit(decode, out_shardings=shardings, donate_argnums=2,
                     static_argnames="steps"),
      decode_rows=jax.jit(decode_rows, out_shardings=shardings, donate_argnums=2,
                          static_argnames=("width", "steps", "block")),
      recompute=jax.jit(recompute, out_shardings=shardings, donate_argnums=1,
                        static_argnames="width"),
      set_pages=jax.jit(counters["set_pages"].wrap(paged_decode.set_page_table),
                        out_shardings=shardings, donate_argnums=0),
      take_rows=jax.jit(counters["take_rows"].wrap(_take_rows)),
      state_shardings=shardings,
      counters=counters,
  )


def read_segments(fns: SamplerFns, state: sampling.SlotState,
                  slots: list[int]) -> list[segments.Segment]:
  """Each slot's current `segments.Segment`, on the host; `slots` is padded to a
  `engine_config.row_bucket` so that reads compile rarely."""
  r = engine_config.row_bucket(len(slots), state.tokens.shape[0])
  idx = np.array(slots + [slots[-1]] * (r - len(slots)), np.int32)
  host = jax.device_get(fns.take_rows(state, idx))
  read = []
  for j in range(len(slots)):
    start = int(host["prompt_end"][j])
    cols = slice(start, start + int(host["token_mask"][j, start:].sum()))
    alternatives = ((host["top_ids"][j, cols], host["top_logprobs"][j, cols])
                    if "top_ids" in host else None)
    read.append(segments.Segment(host["tokens"][j, cols], host["logprobs"][j, cols],
                            host["versions"][j, cols], bool(host["stopped"][j]), alternatives))
  return read


def open_segments(fns: SamplerFns, state, slots: list, waiting) -> dict:
  """`{(group_id, sample_index): (tokens, logprobs, versions)}` of every
  segment under way: read from the occupied `slots` (`waiting_rows.Row` or
  None each) of `state`, and held by the `waiting` rows that were preempted
  (their episodes' open segments)."""
  partials = {(row.group_id, row.episode.sample_index): (
      row.episode.open_tokens, row.episode.open_logprobs, row.episode.open_versions)
      for row in waiting if row.episode.open_tokens}
  occupied = [i for i, row in enumerate(slots) if row is not None]
  if occupied and state is not None:
    for slot, segment in zip(occupied, read_segments(fns, state, occupied)):
      episode = slots[slot].episode
      partials[(episode.group_id, episode.sample_index)] = segment[:3]
  return partials
