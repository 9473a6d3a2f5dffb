"""`EngineConfig`: the sampler engine's settings, the `sampler` section of an
experiment config (with `SamplingSettings`' keys), and the slot geometry they
imply (prompt buckets, continuation buckets, slot length, KV pages and the
attention spans a paged engine reads)."""

from __future__ import annotations

import dataclasses

import numpy as np

from arl_jax.core import settings
from arl_jax.models import paged_names
from arl_jax.sampler import weight_updates

KV_CACHES = ("dense", "paged")
_check = settings.check


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Attributes:
    num_slots: rows decoded together (a multiple of the group size and of the
      sampler mesh's data axis).
    prompt_len: the longest prompt accepted, in tokens (the largest bucket).
    prompt_buckets: shorter lengths prompts are padded to besides
      `prompt_len` (each a program shape; a prompt takes the smallest that
      holds it). After construction: every bucket, ascending, `prompt_len`
      last.
    max_new_tokens: N, the completion budget (tokens of all turns together).
    param_dtype: the dtype the sampler holds and computes the model in
      ("float32" or "bfloat16"; the learner keeps `model.param_dtype`).
    weight_update: how a new version reaches rows in flight: one of
      `weight_updates.WEIGHT_UPDATE_MODES` (`sampler/weight_updates.py`).
    kv_policy: `in_flight`: what happens to a row's KV cache at a swap, one
      of `weight_updates.KV_POLICIES` (keep it, or recompute it).
    precompile: compile every program shape the engine can use
      (`precompile.engine_shapes`) when the first published version is taken
      up, so that no rare shape compiles late in a run (hundreds of updates
      in); off, each compiles when a batch first needs it.
    kv_cache: "dense" (every slot holds `length` columns of KV cache and a
      decode step attends over all of them), "paged" (a pool of pages handed
      to slots as they grow; a step attends over the columns its rows'
      contexts need: `kv_slots.py`) or "auto" (paged from
      `auto_settings.PAGED_FROM_COLUMNS` columns a slot; chosen by
      `auto_settings.resolve` before an engine is built, and printed in the
      run's header).
    page_size: columns per page (paged).
    kv_pages: pages of the pool, page 0 (never handed out) included; 0:
      enough for every slot at full length. When slots need more than the
      pool has, the engine preempts the youngest (`scheduler.py`).
    kv_memory_fraction: paged: size the pool to this fraction of a sampler
      device's memory instead of `kv_pages` (0: off); `--dry_run` prints the
      pages it makes.
    share_prompts: rows admitted together with the same context (a group's
      samples) are prefilled once and the others start from that prefill
      (`sampling.fork`); paged, they share the prompt's pages.
    decode_burst: decode steps one device call takes while nothing waits
      for the engine between steps (no row to admit, no cancellation, one
      version to decode): one host round trip per `decode_burst` tokens. A
      publish, a cancellation, new work or a checkpoint pause waits for the
      burst to end; a slot that finishes inside one idles until then. 0:
      auto (`auto_settings.decode_burst`: 4 where a decode step is estimated
      under a host round trip).
    prefill_chunk: columns a context is prefilled in per engine iteration
      when it is longer (0: every context in one call, but see
      `chunk_columns`). The chunks of a long prompt, multi-turn, preempted
      or restored context go between decode steps of the other slots, so a
      long prefill delays each of their steps by one chunk's cost, not by
      its whole.
    paged_attention: how a paged engine's decode steps attend: "xla" (the
      decoder's attention over the pages, read in blocks), "pallas" (JAX's
      Pallas paged attention kernel, GPU; "pallas_interpret" runs it in
      interpret mode on any backend) or "ragged" (JAX's ragged paged
      attention kernel, TPU, over an interleaved pool:
      `models/paged_attention.py`).
    attention_block: columns a paged engine's XLA attention reads per loop
      iteration in decode steps and prefill chunks (rounded up to whole
      pages): a call reads as many blocks as its rows' contexts need, and
      one program per row bucket serves every context length
      (`models/paged_blocks.py`). 0: one program per width of
      `decode_widths` instead (seven at 1,056-column slots; start-up and
      speed of both in `benchmarks/engine_defaults.py`). Kernel attentions
      (`paged_attention` other than "xla") read each row's own pages
      themselves and keep the widths.
    max_prefill_tokens: prompt tokens one engine iteration may prefill,
      spent on the chunks of prefills under way, then on admissions in
      queue order (0: no limit): it bounds the stall prefills put between
      two decode steps of the live slots (`prefill_budget.py`).
    max_insert_rows: rows one insert program prefills at once (0: every
      row admitted together, up to `num_slots`). An insert holds every
      layer's fresh keys and values of its rows until it writes them to
      their slots (rows x context x layers: 0.7 GiB when SmolLM2's
      evaluation admits its 200 prompts at once); the rows beyond the cap
      go in further inserts of the same engine iteration, so what is
      admitted when is unchanged.
    context_bucket: granularity of re-admitted context lengths (contexts
      longer than the longest prompt: multi-turn episodes, preempted rows,
      segments a checkpoint left open; capped at `max_new_tokens`, see
      `context_step`).
    group_size: G, rollouts per group (the run's `orchestrator.group_size`).
    seed: base of the per-rollout PRNG keys (the run's `seed`).
    multi_turn: episodes may be resumed after an environment turn (the
      run's environment says).
  """

  num_slots: int
  prompt_len: int
  prompt_buckets: tuple[int, ...] = ()
  max_new_tokens: int
  param_dtype: str = "float32"
  weight_update: str = "in_flight"
  kv_policy: str = "keep"
  precompile: bool = True
  kv_cache: str = "auto"
  page_size: int = 16
  kv_pages: int = 0
  kv_memory_fraction: float = 0.0
  share_prompts: bool = True
  decode_burst: int = 0
  prefill_chunk: int = 0
  paged_attention: str = "xla"
  attention_block: int = 128
  max_prefill_tokens: int = 0
  max_insert_rows: int = 0
  context_bucket: int = 16
  group_size: int = settings.derived(1, "orchestrator.group_size")
  seed: int = settings.derived(0, "seed")
  multi_turn: bool = settings.derived(False, "the environment")

  def __post_init__(self):
    ints = ("num_slots", "prompt_len", "max_new_tokens", "page_size", "context_bucket",
            "group_size")
    for key in ints:
      value = getattr(self, key)
      _check(settings.is_int(value) and value >= 1, key, f"must be an int >= 1, got {value!r}")
    for key, zero in (("kv_pages", ">= 0 (0: every slot at full length)"),
                      ("decode_burst", ">= 1 (0: auto)"), ("prefill_chunk", ">= 0 (0: off)"),
                      ("attention_block", ">= 0 (0: a program per width)"),
                      ("max_prefill_tokens", ">= 0 (0: no limit)"),
                      ("max_insert_rows", ">= 0 (0: no limit)")):
      value = getattr(self, key)
      _check(settings.is_int(value) and value >= 0, key, f"must be an int {zero}, got {value!r}")
    for key in ("precompile", "share_prompts", "multi_turn"):
      _check(isinstance(getattr(self, key), bool), key,
             f"must be True or False, got {getattr(self, key)!r}")
    buckets = tuple(self.prompt_buckets)
    _check(all(settings.is_int(b) and 0 < b <= self.prompt_len for b in buckets),
           "prompt_buckets", f"{buckets}: every bucket must be in [1, prompt_len="
           f"{self.prompt_len}]")
    object.__setattr__(self, "prompt_buckets", tuple(sorted(set(buckets) | {self.prompt_len})))
    _check(self.param_dtype in ("float32", "bfloat16"), "param_dtype",
           f"must be float32 or bfloat16, got {self.param_dtype!r}")
    _check(self.weight_update in weight_updates.WEIGHT_UPDATE_MODES, "weight_update",
           f"must be one of {weight_updates.WEIGHT_UPDATE_MODES}, got {self.weight_update!r}")
    _check(self.kv_policy in weight_updates.KV_POLICIES, "kv_policy",
           f"must be one of {weight_updates.KV_POLICIES}, got {self.kv_policy!r}")
    weight_updates.check_names(self.weight_update, self.kv_policy)
    _check(self.kv_cache in (*KV_CACHES, "auto"), "kv_cache",
           f"must be one of {(*KV_CACHES, 'auto')}, got {self.kv_cache!r}")
    _check(isinstance(self.kv_memory_fraction, (int, float))
           and 0 <= self.kv_memory_fraction < 1, "kv_memory_fraction",
           f"must be in [0, 1) (0: off), got {self.kv_memory_fraction!r}")
    _check(not self.kv_memory_fraction or self.kv_cache != "dense", "kv_memory_fraction",
           "sizes a paged KV pool: it needs kv_cache='paged' (or 'auto')")
    _check(not (self.kv_memory_fraction and self.kv_pages), "kv_memory_fraction",
           f"and kv_pages={self.kv_pages} both size the pool: set one of them")
    _check(self.paged_attention in paged_names.ATTENTIONS, "paged_attention",
           f"must be one of {paged_names.ATTENTIONS}, got {self.paged_attention!r}")
    _check(self.paged_attention == "xla" or self.kv_cache != "dense", "paged_attention",
           f"={self.paged_attention!r} reads a paged pool: it needs kv_cache='paged' (or 'auto')")
    _check(self.num_slots >= self.group_size, "num_slots",
           f"{self.num_slots} must be >= the group size {self.group_size}")
    _check(not (self.paged and self.kv_pages and self.kv_pages - 1 < self.pages_per_slot),
           "kv_pages", f"{self.kv_pages} pages cannot hold one sequence of the longest length: "
           f"a slot holds up to {self.length} columns = {self.pages_per_slot} pages of "
           f"{self.page_size} (page 0 is never handed out), so the pool needs >= "
           f"{self.pages_per_slot + 1}")

  @property
  def resolved(self) -> bool:
    """Whether the settings left to auto (`kv_cache`, `decode_burst`) are
    chosen (`auto_settings.resolve`): an engine runs only a resolved config."""
    return self.kv_cache != "auto" and self.decode_burst >= 1

  def check_resolved(self) -> None:
    if not self.resolved:
      raise ValueError(
          f"kv_cache={self.kv_cache!r}, decode_burst={self.decode_burst}: an engine runs with "
          "these chosen (auto_settings.resolve does it for a run's config): set them, or "
          "resolve the config first")

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
  def context_step(self) -> int:
    """Granularity of continuation buckets: `context_bucket`, but no more than
    the budget (a short single-turn budget should not pay for 16 spare columns)."""
    return min(self.context_bucket, self.max_new_tokens)

  @property
  def paged(self) -> bool:
    return self.kv_cache == "paged"

  @property
  def insert_rows(self) -> int:
    """The most rows one insert program takes (`max_insert_rows`, at most
    `num_slots`)."""
    return min(self.num_slots, self.max_insert_rows or self.num_slots)

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
    """Pages of a paged engine's pool (`kv_pages`, or its default); 0 when dense."""
    if not self.paged:
      return 0
    return self.kv_pages or self.num_slots * self.pages_per_slot + 1

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


# The narrowest prompt bucket `with_length_buckets` makes: below it a prefill
# costs about the same whatever its width (per-call overheads dominate).
_MIN_LENGTH_BUCKET = 32


def with_length_buckets(cfg: EngineConfig) -> EngineConfig:
  """`cfg` padding new prompts to the next power of two from 32 (capped at
  `prompt_len`) when it names no `prompt_buckets` of its own.

  For engines whose admissions are small and whose prompts are short
  against `prompt_len`: a served engine (requests arrive a few at a time)
  and the greedy evaluation (each prompt prefilled on its own). There,
  padding every prompt to `prompt_len` made prefill most of the work:
  SmolLM2's 400 held-out ~50-token prompts padded to 256 took 390 s to
  evaluate. A prompt always lands in the same bucket, so evaluations stay
  comparable. The run's own sampler keeps `prompt_len` unless configured:
  it prefills whole admissions, and every bucket is more programs to
  compile."""
  if cfg.prompt_buckets != (cfg.prompt_len,):
    return cfg
  buckets = tuple(b for b in row_buckets(cfg.prompt_len) if b >= _MIN_LENGTH_BUCKET)
  return dataclasses.replace(cfg, prompt_buckets=buckets or (cfg.prompt_len,))


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
