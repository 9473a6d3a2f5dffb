"""Compiling every program a sampler engine can run, before its first admission.

The engine pads admissions and segment reads to power-of-two row counts
(`engine_config.row_bucket`) and contexts to buckets, so it calls its slot
functions with a bounded set of shapes; but jit compiles a shape only when a
batch first needs it, and a rare one (16 rows admitted at once) can first come
800 updates into a run, which then stalls on the compile (minutes on a TPU
pod). `compile_all` lowers and compiles every shape up front with
`jax.ShapeDtypeStruct` arguments that carry the live arrays' shardings; the
jit cache keeps each executable, so a later call with those shapes neither
traces nor compiles (`tests/sampler/precompile_test.py` checks it with JAX's
compile events).

`engine_shapes` says which shapes an engine can use: new requests come as
whole groups of one prompt, so single-turn admissions are multiples of the
group size in a prompt bucket (or one row per group when its samples share
its prefill, and `fork` any number of rows); resumed multi-turn episodes and
episodes a checkpoint left come back in any number, with contexts in any
continuation bucket; a harvest reads any number of slots. A paged engine
decodes any row bucket of slots (`decode_rows`; at every width of
`EngineConfig.decode_widths` unless its attention reads blocks,
`EngineConfig.decode_block`), recomputes at every width, and sends page
tables (`set_pages`). Rows a
paged engine preempts come back in any number, with their prompts and what
they sampled: contexts that fit a prompt bucket are inserted, longer ones
prefilled in chunks (`EngineConfig.chunk_columns`). A chunked prefill has
programs for row counts and widths only (`begin_prefill`, `prefill_chunk`),
whatever the context's length, and a bucket whose contexts are all chunked
needs no insert program at all.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp

from arl_jax.sampler import engine_config, insert_batch, slot_fns


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The argument shapes an engine's slot functions can be called with
  (`decode` has one, for every engine).

  Attributes:
    insert: `(rows, bucket)` of each `insert_from_ids` shape: a row bucket
      and a context bucket.
    take_rows: the row buckets segment reads use.
    recompute: whether `recompute` can run (the in-flight `recompute` KV policy).
    widths: the attention widths of decode and recompute (`(None,)`: dense).
    paged: whether page tables are sent (`set_pages`).
    fork: the row buckets of `fork` (shared prompts; empty when off).
    steps: the step counts of decode calls (1, and `decode_burst`).
    begin: the row buckets of `begin_prefill` (chunked prefill; empty when off).
    prefill: `(rows, width)` of each `prefill_chunk` program (width None
      when it reads blocks of `decode_block`, or, dense, every column).
    chunk: columns per chunk (`EngineConfig.chunk_columns`).
    decode_block: columns per block of a paged decode's and prefill
      chunk's attention loop (`EngineConfig.decode_block`): their programs
      then have no width, one per row bucket; 0: one per row bucket and width.
  """

  insert: tuple[tuple[int, int], ...]
  take_rows: tuple[int, ...]
  recompute: bool
  widths: tuple[int | None, ...] = (None,)
  paged: bool = False
  fork: tuple[int, ...] = ()
  steps: tuple[int, ...] = (1,)
  begin: tuple[int, ...] = ()
  prefill: tuple[tuple[int, int | None], ...] = ()
  chunk: int = 0
  decode_block: int = 0

  @property
  def decode(self) -> tuple[tuple[int | None, int | None, int], ...]:
    """`(rows, width, steps)` of each decode program: dense, `decode` of
    every slot (`(None, None, steps)`); paged, `decode_rows` of every row
    bucket, at each width unless it reads blocks (width None); each at every
    step count."""
    rows = self.take_rows if self.paged else (None,)
    widths = (None,) if self.decode_block else self.widths
    return tuple((r, w, n) for n in self.steps for w in widths for r in rows)

  @property
  def num_programs(self) -> int:
    """Programs `compile_all` compiles: these shapes, the decode programs,
    `recompute` at each width, and `set_pages` when paged."""
    return (len(self.insert) + len(self.fork) + len(self.take_rows) + len(self.decode)
            + len(self.widths) * int(self.recompute) + int(self.paged) + len(self.begin)
            + len(self.prefill))


def engine_shapes(cfg: engine_config.EngineConfig,
                  restored_lengths: Iterable[int] = ()) -> Shapes:
  """Every shape an engine configured by `cfg` can use.

  Args:
    cfg: the engine's settings.
    restored_lengths: context length (prompt and completion so far) of each
      episode a checkpoint left (`SamplerEngine.restore`).

  Returns:
    The insert shapes (row bucket x context bucket), the read shapes (every
    row bucket: a harvest reads however many slots finished) and whether
    `recompute` can run.
  """
  restored = [cfg.bucket_for(n) for n in restored_lengths]
  if cfg.multi_turn:
    # Episodes come back from their environments one by one, with contexts
    # of any length: any number of rows in any continuation bucket.
    rows, buckets = engine_config.row_buckets(cfg.num_slots), cfg.continuation_buckets
  elif restored or cfg.can_preempt:
    # Restored or preempted episodes (open segments included) come in any
    # number, before and next to whole groups.
    rows = engine_config.row_buckets(cfg.num_slots)
    buckets = tuple(sorted(set(cfg.prompt_buckets) | set(restored)))
  elif cfg.share_prompts:
    # One row per prompt: the groups admitted at once, and the rest of a
    # group whose first rows were admitted earlier (a full page pool).
    sources = min(cfg.num_slots // cfg.group_size + 1, cfg.num_slots)
    rows = tuple(sorted({engine_config.row_bucket(n, cfg.num_slots)
                         for n in range(1, sources + 1)}))
    buckets = cfg.prompt_buckets
  else:
    # New requests are whole groups of one prompt, so one bucket each.
    rows = engine_config.row_buckets(cfg.num_slots, cfg.group_size)
    buckets = cfg.prompt_buckets
  # Any number of rows can be prefilling at once, at any width that holds a chunk.
  if cfg.insert_rows < cfg.num_slots:
    # Admissions split into inserts of at most `insert_rows`: any number up to it.
    rows = engine_config.row_buckets(cfg.insert_rows)
  chunk_rows = engine_config.row_buckets(cfg.num_slots) if cfg.prefill_widths else ()
  return Shapes(
      insert=tuple((r, b) for b in buckets if not cfg.chunks_all(b) for r in rows),
      take_rows=engine_config.row_buckets(cfg.num_slots),
      recompute=cfg.weight_update == "in_flight" and cfg.kv_policy == "recompute",
      widths=cfg.decode_widths, paged=cfg.paged,
      # Any number of rows can start from another's prefill.
      fork=engine_config.row_buckets(cfg.num_slots) if cfg.share_prompts else (),
      steps=tuple(sorted({1, cfg.decode_burst})), begin=chunk_rows,
      prefill=tuple((r, w) for w in ((None,) if cfg.decode_block and cfg.prefill_widths
                                     else cfg.prefill_widths) for r in chunk_rows),
      chunk=cfg.chunk_columns, decode_block=cfg.decode_block)


def _abstract(x) -> jax.ShapeDtypeStruct:
  """`x`'s shape and dtype, and its sharding if it is committed to one: an
  uncommitted array (like a host array) leaves its placement to jit, and an
  abstract argument must say the same to land in the same cache entry."""
  committed = getattr(x, "committed", False)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None,
                              weak_type=getattr(x, "weak_type", False))


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What `compile_all` did: its seconds, and each program's temporaries
  (bytes XLA's `memory_analysis` says the program holds while it runs,
  beyond its arguments and outputs; None where the backend does not say)."""

  seconds: float
  temporaries: dict[str, int | None]

  def largest(self) -> tuple[str, int] | None:
    """`(label, bytes)` of the program with the most temporaries."""
    known = [(b, label) for label, b in self.temporaries.items() if b is not None]
    return None if not known else max(known)[::-1]


def _temporaries(compiled) -> int | None:
  try:
    return int(compiled.memory_analysis().temp_size_in_bytes)
  except (AttributeError, NotImplementedError, TypeError):  # (a backend that does not say)
    return None


def compile_all(fns: slot_fns.SamplerFns, shapes: Shapes, *, params, state, base_key,
                num_stop_ids: int,
                progress_fn: Callable[[int, int, str], None] | None = None) -> Compiled:
  """Compiles `decode` and every shape of `shapes` for arguments laid out
  as the engine passes them, one program at a time.

  Args:
    fns: the engine's slot functions.
    shapes: what to compile (`engine_shapes`).
    params: params as published (their shardings are those of every later
      version: `param_swap` refuses any other).
    state: the engine's SlotState.
    base_key: the engine's `[2]` uint32 PRNG base key (a host array).
    num_stop_ids: S, stop ids of the sampling settings.
    progress_fn: called `(done, total, label)` after each program (a
      compile can take minutes on an accelerator: the run shows how far
      along it is); `done == 0` before the first.

  Returns:
    The seconds spent and each program's temporaries (`Compiled`).
  """
  start = time.monotonic()
  params, state = jax.tree.map(_abstract, params), jax.tree.map(_abstract, state)
  # As the engine passes them: the version a host scalar (`jnp.int32`), the
  # row masks placed like the slots, the slot indices of a read a host array.
  version = jax.ShapeDtypeStruct((), jnp.int32)
  count = jax.ShapeDtypeStruct((), jnp.int32)  # attention blocks (a host scalar)
  rows = jax.ShapeDtypeStruct(state.done.shape, jnp.bool_, sharding=fns.row_sharding)
  key = jax.ShapeDtypeStruct(base_key.shape, base_key.dtype)
  programs = []  # (label, a function that lowers it)
  for r, width, steps in shapes.decode:
    if r is None:
      programs.append((f"decode steps={steps}", functools.partial(
          fns.decode.lower, params, version, state, rows, rows, steps=steps)))
    elif width is None:  # reads blocks: how many is a host scalar
      programs.append((f"decode rows={r} blocks of {shapes.decode_block} steps={steps}",
                       functools.partial(
                           fns.decode_rows.lower, params, version, state, rows,
                           jax.ShapeDtypeStruct((r,), jnp.int32), count, width=None,
                           steps=steps, block=shapes.decode_block)))
    else:  # the engine passes the slot indices as a host array
      programs.append((f"decode rows={r} width={width} steps={steps}", functools.partial(
          fns.decode_rows.lower, params, version, state, rows,
          jax.ShapeDtypeStruct((r,), jnp.int32), width=width, steps=steps)))
  for width in shapes.widths if shapes.recompute else ():
    programs.append((f"recompute width={width}", functools.partial(
        fns.recompute.lower, params, state, rows, width=width)))
  if shapes.paged:
    table = state.cache.page_table
    programs.append(("set_pages", functools.partial(
        fns.set_pages.lower, state, jax.ShapeDtypeStruct(table.shape, table.dtype))))
  for r, bucket in shapes.insert:
    batch = insert_batch.abstract(r, bucket, num_stop_ids)
    programs.append((f"insert rows={r} context={bucket}", functools.partial(
        fns.insert_from_ids.lower, params, version, state, key, *batch.args())))
  for r in shapes.fork:
    batch = insert_batch.abstract_fork(r, num_stop_ids)
    programs.append((f"fork rows={r}", functools.partial(
        fns.fork.lower, state, key, *batch.args())))
  for r in shapes.begin:
    batch = insert_batch.abstract_begin(r, state.tokens.shape[1], num_stop_ids)
    programs.append((f"begin_prefill rows={r}", functools.partial(
        fns.begin_prefill.lower, state, key, *batch.args())))
  for r, width in shapes.prefill:  # (rows, start, final: host arrays)
    indices = jax.ShapeDtypeStruct((r,), jnp.int32)
    final = jax.ShapeDtypeStruct((r,), jnp.bool_)
    if shapes.decode_block:  # reads blocks: how many is a host scalar
      programs.append((f"prefill_chunk rows={r} blocks of {shapes.decode_block}",
                       functools.partial(
                           fns.prefill_chunk.lower, params, version, state, indices, indices,
                           final, count, chunk=shapes.chunk, width=None,
                           block=shapes.decode_block)))
      continue
    programs.append((f"prefill_chunk rows={r} width={width}", functools.partial(
        fns.prefill_chunk.lower, params, version, state, indices, indices, final,
        chunk=shapes.chunk, width=width)))
  for r in shapes.take_rows:
    programs.append((f"take_rows rows={r}", functools.partial(
        fns.take_rows.lower, state, jax.ShapeDtypeStruct((r,), jnp.int32))))
  if progress_fn is not None:
    progress_fn(0, len(programs), programs[0][0] if programs else "")
  temporaries = {}
  for done, (label, lower) in enumerate(programs, start=1):
    temporaries[label] = _temporaries(lower().compile())
    if progress_fn is not None:
      progress_fn(done, len(programs), label)
  return Compiled(seconds=time.monotonic() - start, temporaries=temporaries)
