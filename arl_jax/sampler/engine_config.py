"""`EngineConfig`: the sampler engine's static settings and the slot geometry
they imply (prompt buckets, continuation buckets, slot length, KV pages and
the attention widths a paged engine compiles)."""

from __future__ import annotations

import dataclasses

import numpy as np

from arl_jax.models import paged_names
from arl_jax.sampler import weight_updates

KV_CACHES = ("dense", "paged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Attributes:
    num_slots: rows decoded together (>= the group size, a multiple of the
      sampler mesh's data axis).
    group_size: G, rollouts per group.
    prompt_buckets: ascending prompt lengths prompts are padded to; the
      largest is the longest prompt accepted.
    max_new_tokens: N, completion budget.
    weight_update: one of `weight_updates.WEIGHT_UPDATE_MODES`.
    kv_policy: one of `weight_updates.KV_POLICIES` (used by `in_flight`).
    seed: base of the per-rollout PRNG keys.
    multi_turn: episodes may be resumed after an environment turn.
    context_bucket: granularity of re-admitted context lengths (contexts
      longer than the longest prompt: multi-turn episodes, and segments a
      checkpoint left open; capped at `max_new_tokens`, see `context_step`).
    precompile: compile every program shape the engine can use
      (`precompile.engine_shapes`) when the first published version is taken
      up (in `SamplerEngine.start` if it was published before), instead of
      when a batch first needs one (which can be hundreds of updates into a
      run). Off here, for engines built by hand that run a few batches; a
      run's engine takes `sampler.precompile` (on by default).
    kv_cache: "dense" (every slot holds `length` columns of KV cache, and a
      decode step attends over all of them) or "paged" (a pool of pages
      handed to slots as they grow; a step decodes slots in groups by the
      columns their contexts need, `decode_span`: `kv_slots.py`).
    page_size: columns per page (paged).
    num_pages: pages of the pool, page 0 (never handed out) included; 0:
      enough for every slot at full length. When slots need more than the
      pool has, the engine preempts (`engine.py`).
    share_prompts: rows admitted together with the same context (a group's
      samples) are prefilled once and the others start from that prefill
      (`sampling.fork`); paged, they share the prompt's pages.
    decode_burst: decode steps one device call takes while nothing waits
      for the engine between steps (no row to admit, no cancellation, one
      version to decode): one host round trip per `decode_burst` tokens. A
      publish, a cancellation, new work or a checkpoint pause waits for the
      burst to end; a slot that finishes inside one idles until then.
    prefill_chunk: columns a context is prefilled in per engine iteration
      when it is longer (0: every context in one call, but see
      `chunk_columns`). The chunks of a long prompt, multi-turn, preempted
      or restored context go between decode steps of the other slots, so a
      long prefill delays each of their steps by one chunk's cost, not by
      its whole (`prefilling.py`).
    paged_attention: how a paged engine's decode steps attend: "xla" (the
      decoder's attention over the gathered pages), "pallas" (JAX's
      Pallas paged attention kernel, GPU; "pallas_interpret" runs it in
      interpret mode on any backend) or "ragged" (JAX's ragged paged
      attention kernel, TPU, over an interleaved pool:
      `models/paged_attention.py`).
    attention_block: columns a paged engine's XLA attention reads per loop
      iteration in decode steps and prefill chunks (rounded up to whole
      pages): a call reads as many blocks as its rows' contexts need, and
      one program per row bucket serves every context length
      (`models/paged_blocks.py`). 0: one program per width of
      `decode_widths` instead (seven at 1,056-column
      slots; start-up and speed of both in `benchmarks/engine_defaults.py`).
      Kernel attentions (`paged_attention` other than "xla") read each
      row's own pages themselves and keep the widths.
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
  precompile: bool = False
  kv_cache: str = "dense"
  page_size: int = 16
  num_pages: int = 0
  share_prompts: bool = True
  decode_burst: int = 1
  prefill_chunk: int = 0
  paged_attention: str = "xla"
  attention_block: int = 128

  def __post_init__(self):
    weight_updates.check_names(self.weight_update, self.kv_policy)
    if not self.prompt_buckets or list(self.prompt_buckets) != sorted(set(self.prompt_buckets)):
      raise ValueError(f"prompt_buckets must be ascending and distinct, got {self.prompt_buckets}")
    if self.context_bucket < 1:
      raise ValueError(f"context_bucket must be >= 1, got {self.context_bucket}")
    if self.kv_cache not in KV_CACHES:
      raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
    if self.page_size < 1:
      raise ValueError(f"page_size must be >= 1, got {self.page_size}")
    if self.num_slots < self.group_size:
      raise ValueError(f"num_slots={self.num_slots} must be >= group_size={self.group_size}")
    if self.decode_burst < 1:
      raise ValueError(f"decode_burst must be >= 1, got {self.decode_burst}")
    paged_names.check_name(self.paged_attention)
    if self.paged_attention != "xla" and not self.paged:
      raise ValueError(f"paged_attention={self.paged_attention!r} needs kv_cache='paged'")
    if self.attention_block < 0:
      raise ValueError(f"attention_block must be >= 0, got {self.attention_block}")
    if self.prefill_chunk < 0:
      raise ValueError(f"prefill_chunk must be >= 0, got {self.prefill_chunk}")
    if self.paged and self.num_pages and self.num_pages - 1 < self.pages_per_slot:
      raise ValueError(
          f"kv_pages={self.num_pages} cannot hold one sequence of the longest length: a slot "
          f"holds up to {self.length} columns = {self.pages_per_slot} pages of {self.page_size} "
          f"(page 0 is never handed out), so the pool needs >= {self.pages_per_slot + 1}")

  def check_request(self, req) -> None:
    """Raises ValueError unless a `GroupRequest` fits: its group size, and a
    prompt of 1 to `prompt_len` tokens."""
    if req.group_size != self.group_size:
      raise ValueError(f"group {req.group_id} has {req.group_size} rollouts; the engine was "
                       f"configured for groups of {self.group_size}")
    if not 0 < len(req.prompt_ids) <= self.prompt_len:
      raise ValueError(f"group {req.group_id}: prompt has {len(req.prompt_ids)} tokens; the "
                       f"sampler takes 1 to {self.prompt_len} (sampler.prompt_len)")

  def check_budget_left(self, episode, what: str) -> None:
    """Raises ValueError when `episode` has no completion budget left."""
    budget = episode.budget(self.max_new_tokens)
    if episode.length >= budget:
      raise ValueError(f"group {episode.group_id}: {what} holds {episode.length} completion "
                       f"tokens; nothing is left of its budget of {budget}")

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
  def paged(self) -> bool:
    return self.kv_cache == "paged"

  @property
  def length(self) -> int:
    """L: columns of a slot (longest prompt bucket + max new tokens, plus the
    spare columns that continuation buckets may round into), rounded up to
    whole pages when paged."""
    length = self.prompt_buckets[-1] + self.max_new_tokens + self.context_step
    if self.paged:
      length = -(-length // self.page_size) * self.page_size
    return length

  @property
  def pages_per_slot(self) -> int:
    return self.length // self.page_size

  @property
  def pool_pages(self) -> int:
    """Pages of a paged engine's pool (`num_pages`, or its default); 0 when dense."""
    if not self.paged:
      return 0
    return self.num_pages or self.num_slots * self.pages_per_slot + 1

  @property
  def decode_widths(self) -> tuple[int | None, ...]:
    """The attention widths (columns) decode and recompute are compiled for:
    a paged engine's power-of-two page counts from the one that holds the
    shortest prompt bucket and its first decode column, up to `length`; a
    dense engine's single `None` (every column)."""
    if not self.paged:
      return (None,)
    widths, pages = [], 1
    while pages * self.page_size <= self.prompt_buckets[0]:
      pages *= 2
    while pages < self.pages_per_slot:
      widths.append(pages * self.page_size)
      pages *= 2
    return (*widths, self.length)

  def width_for(self, last_column: int) -> int | None:
    """The smallest of `decode_widths` that holds column `last_column`."""
    return next(w for w in self.decode_widths if w is None or w > last_column)

  @property
  def decode_block(self) -> int:
    """Columns per block of a paged decode step's and prefill chunk's
    attention loop (`attention_block` in whole pages, at most the slot's `length`); 0 when
    decode steps compile a program per width instead (dense, a kernel
    attention, or `attention_block` 0)."""
    if not self.paged or self.paged_attention != "xla" or not self.attention_block:
      return 0
    block = -(-self.attention_block // self.page_size) * self.page_size
    return min(block, self.length)

  def decode_span(self, last_column: int) -> int | None:
    """Columns a decode step whose last write lands at column `last_column`
    reads: whole blocks of `decode_block`, or `width_for`'s width."""
    if not self.decode_block:
      return self.width_for(last_column)
    return (last_column // self.decode_block + 1) * self.decode_block

  def attention_args(self, span: int | None) -> tuple[tuple, dict]:
    """`(args, kwargs)` that make a paged `decode_rows` or `prefill_chunk`
    call read `span` columns (a `decode_span`): the blocks to read (a host
    int32, one program for every span) or the compiled width."""
    if block := self.decode_block:
      return (np.int32(span // block),), {"width": None, "block": block}
    return (), {"width": span}

  @property
  def can_preempt(self) -> bool:
    """Whether slots can need more pages than the pool has (`kv_slots.py`)."""
    return self.paged and self.pool_pages - 1 < self.num_slots * self.pages_per_slot

  @property
  def chunk_columns(self) -> int:
    """Columns per chunk of a chunked prefill (0: none is chunked):
    `prefill_chunk`; without it, the longest prompt bucket in an engine
    that can preempt. A preempted row comes back with its prompt and what
    it sampled, a context of any length: inserted whole, each new length
    (continuation bucket) and row count would compile its own insert
    program in the middle of the run (36 compiles, 40 s of a 99 s busy
    time in `benchmarks/long_context.py`'s long tail; minutes on a TPU),
    where chunk programs exist per row count and width only. Contexts
    that fit a prompt bucket are still inserted whole."""
    if self.prefill_chunk:
      return self.prefill_chunk
    return self.prompt_len if self.can_preempt else 0

  def chunked(self, context_len: int) -> bool:
    """Whether a context of `context_len` tokens is prefilled in chunks."""
    return 0 < self.chunk_columns < context_len

  def chunks_all(self, bucket: int) -> bool:
    """Whether every context padded to `bucket` (one of
    `continuation_buckets`) is chunked: none needs an insert program."""
    below = [b for b in self.continuation_buckets if b < bucket]
    return self.chunked(max(below, default=0) + 1)

  @property
  def prefill_widths(self) -> tuple[int | None, ...]:
    """The attention widths chunks are compiled for: those of `decode_widths`
    that hold a chunk (a chunk ends at or before its context's bucket); none
    when no context is chunked."""
    if not self.chunked(self.continuation_buckets[-1]):
      return ()
    smallest = self.width_for(self.chunk_columns - 1)
    return tuple(w for w in self.decode_widths if w is None or w >= smallest)

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

  def bucket_for(self, n: int) -> int:
    """The continuation bucket a context of `n` tokens is padded to."""
    return next(b for b in self.continuation_buckets if b >= n)


def kv_bytes_per_column(model_cfg, tp: int = 1) -> int:
  """Bytes of one KV cache column (every layer's keys and values) on one
  device of a sampler mesh whose `tp` axis splits the KV heads, in the
  sampler's parameter dtype (`model_cfg.param_dtype`)."""
  heads = -(-model_cfg.num_kv_heads // tp)
  return (model_cfg.num_layers * 2 * heads * model_cfg.head_dim
          * np.dtype(model_cfg.param_dtype).itemsize)


def row_bucket(n: int, limit: int) -> int:
  """Rows an insert of `n` is padded to: the smallest power of two >= n, capped
  at `limit` (so a handful of insert shapes cover every admission)."""
  return min(1 << max(n - 1, 0).bit_length(), limit)


def row_buckets(limit: int, multiple_of: int = 1) -> tuple[int, ...]:
  """Every `row_bucket` of a row count in [1, limit] that is a multiple of
  `multiple_of`, ascending (the insert and read shapes such counts need)."""
  return tuple(sorted({row_bucket(n, limit) for n in range(multiple_of, limit + 1, multiple_of)}))


def chunk_starts(context_len: int, chunk: int) -> list[int]:
  """The first column of each chunk of a context of `context_len` tokens
  (at least a chunk), in prefill order."""
  if context_len < chunk:
    raise ValueError(f"a chunked context ({context_len} tokens) must hold a chunk ({chunk})")
  count = -(-context_len // chunk)
  return [max(context_len - (count - k) * chunk, 0) for k in range(count)]
