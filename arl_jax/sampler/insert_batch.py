"""`InsertBatch`: the host arrays of one prefill, packed from waiting episodes.

An admission prefills the episodes that share a context bucket with one
`SamplerFns.insert` call. Their contexts (prompt, completion so far, and the
open segment a checkpoint left) are left-padded to the bucket for the
prefill (`sampling.insert` moves each row to column 0 of its slot), and the row count is padded to a
power of two (`engine_config.row_bucket`) by repeating the last row, so that a
handful of insert shapes cover every admission; `abstract` describes the
batch of one shape, for compiling that shape before any admission needs it.
The other samples of a prompt admitted at once start from its prefill
(`ForkBatch`, `sampling.fork`). A context prefilled in chunks
(`prefill_chunks.py`) is put in its slot first (`BeginBatch`): rows of any
length together, each a full slot row wide, from column 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from arl_jax.core import episode as episode_lib
from arl_jax.core import rows as rows_lib
from arl_jax.sampler import engine_config, sampling, token_draw


@dataclasses.dataclass(frozen=True)
class InsertBatch:
  """The arguments of `SamplerFns.insert_from_ids` after `(params, version,
  state, base_key)`, for R rows (a power of two) in a bucket of Pb columns.

  Attributes:
    slots: `[R]` int32 slot of each row (a repeated row rewrites the same slot).
    tokens: `[R, Pb]` int32 left-padded contexts.
    mask: `[R, Pb]` bool, True on context tokens.
    key_ids: `[R, 3]` uint32 (group id, sample index, turn): what each row's
      PRNG key is derived from (`token_draw.segment_keys`).
    max_new: `[R]` int32 tokens each row's segment may sample.
    stop_mask: `[R, S]` bool, which stop ids end each row's segment.
    open_len: `[R]` int32 tokens of an open segment at the end of each context.
    open_logprobs: `[R, Pb]` float32 their recorded log-probs (last columns).
    open_versions: `[R, Pb]` int32 their recorded versions (last columns).
  """

  slots: np.ndarray
  tokens: np.ndarray
  mask: np.ndarray
  key_ids: np.ndarray
  max_new: np.ndarray
  stop_mask: np.ndarray
  open_len: np.ndarray
  open_logprobs: np.ndarray
  open_versions: np.ndarray

  def args(self) -> tuple:
    """The arrays in `SamplerFns.insert_from_ids`' argument order."""
    return (self.slots, self.tokens, self.mask, self.key_ids, self.max_new, self.stop_mask,
            self.open_len, self.open_logprobs, self.open_versions)


def stop_mask_row(settings: sampling.SamplingSettings, row_stop_ids) -> np.ndarray:
  """`[S]` bool: which of `settings.stop_ids` end a row whose segments stop on
  `row_stop_ids` (EOS always does; it need not be listed).

  Raises:
    ValueError: a stop id of the row that the sampler was not built with.
  """
  wanted = set(row_stop_ids) - {settings.eos_id}
  unknown = sorted(wanted - set(settings.stop_ids))
  if unknown:
    raise ValueError(f"stop ids {unknown} are not among the sampler's stop_ids "
                     f"{settings.stop_ids}")
  return np.array([i in wanted for i in settings.stop_ids], bool)


def request_stop_mask(settings: sampling.SamplingSettings, stop_ids_fn, request) -> np.ndarray:
  """`[S]` bool: which of `settings.stop_ids` end the segments of a group
  request's episodes; `stop_ids_fn(prompt)` gives its stop tokens (None: all)."""
  if stop_ids_fn is None:
    return np.ones((len(settings.stop_ids),), bool)
  try:
    return stop_mask_row(settings, stop_ids_fn(request.prompt))
  except ValueError as e:
    raise ValueError(f"group {request.group_id}: {e}") from e


def pack(items: list[tuple[int, episode_lib.Episode]], *, bucket: int, num_slots: int,
         max_new_tokens: int, pad_id: int,
         stop_mask_fn: Callable[[object], np.ndarray]) -> InsertBatch:
  """Packs `(slot, episode)` pairs into one insert.

  Args:
    items: the slots to fill and the episodes that go there (at least one).
    bucket: Pb, the context bucket (at least every context's length).
    num_slots: B, the cap of the padded row count.
    max_new_tokens: the sampler's completion budget; every completion token
      counts against it (and against the episode's own budget), observations
      included.
    pad_id: filler of the context columns before a context.
    stop_mask_fn: group request -> `[S]` bool, which stop ids end its segments.
  """
  r = engine_config.row_bucket(len(items), num_slots)
  padded = items + [items[-1]] * (r - len(items))  # duplicates rewrite the same slot
  episodes = [episode for _, episode in padded]
  tokens, mask = rows_lib.left_pad([e.context_ids() for e in episodes], bucket, pad_id)
  # A segment left open by a checkpoint continues: its tokens end the context.
  open_logprobs, _ = rows_lib.left_pad([e.open_logprobs for e in episodes], bucket, 0.0,
                                       np.float32)
  open_versions, _ = rows_lib.left_pad([e.open_versions for e in episodes], bucket,
                                       sampling.NO_VERSION, np.int32)
  return InsertBatch(
      slots=np.array([slot for slot, _ in padded], np.int32),
      tokens=tokens, mask=mask,
      **_segment_fields(episodes, max_new_tokens, stop_mask_fn),
      open_len=np.array([len(e.open_tokens) for e in episodes], np.int32),
      open_logprobs=open_logprobs, open_versions=open_versions)


@dataclasses.dataclass(frozen=True)
class ForkBatch:
  """The arguments of `SamplerFns.fork` after `(state, base_key)`, for R rows
  (a power of two): slots started on the prompt other slots were just given.

  Attributes:
    src: `[R]` int32 slot each row copies its prompt from.
    dst: `[R]` int32 slot of each row (a repeated row rewrites the same slot).
    key_ids, max_new, stop_mask: as `InsertBatch`.
  """

  src: np.ndarray
  dst: np.ndarray
  key_ids: np.ndarray
  max_new: np.ndarray
  stop_mask: np.ndarray

  def args(self) -> tuple:
    return (self.src, self.dst, self.key_ids, self.max_new, self.stop_mask)


def pack_fork(items: list[tuple[int, int, episode_lib.Episode]], *, num_slots: int,
              max_new_tokens: int,
              stop_mask_fn: Callable[[object], np.ndarray]) -> ForkBatch:
  """Packs `(slot, source slot, episode)` triples into one fork (see `pack`)."""
  r = engine_config.row_bucket(len(items), num_slots)
  padded = items + [items[-1]] * (r - len(items))
  episodes = [episode for _, _, episode in padded]
  return ForkBatch(
      src=np.array([source for _, source, _ in padded], np.int32),
      dst=np.array([slot for slot, _, _ in padded], np.int32),
      **_segment_fields(episodes, max_new_tokens, stop_mask_fn))


@dataclasses.dataclass(frozen=True)
class BeginBatch:
  """The arguments of `SamplerFns.begin_prefill` after `(state, base_key)`,
  for R rows (a power of two), each `L` columns wide (a slot's row).

  Attributes:
    slots: `[R]` int32 slot of each row.
    tokens: `[R, L]` int32, each context from column 0, then pad.
    token_mask: `[R, L]` bool, True on context tokens.
    logprobs: `[R, L]` float32 an open segment's recorded log-probs (its columns).
    versions: `[R, L]` int32 their versions (likewise).
    key_ids, max_new, stop_mask: as `InsertBatch`.
    context_len: `[R]` int32 context tokens of each row.
    open_len: `[R]` int32 open-segment tokens at the end of each context.
    first: `[R]` int32 first column of each row's first chunk.
  """

  slots: np.ndarray
  tokens: np.ndarray
  token_mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  key_ids: np.ndarray
  max_new: np.ndarray
  stop_mask: np.ndarray
  context_len: np.ndarray
  open_len: np.ndarray
  first: np.ndarray

  def args(self) -> tuple:
    return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def pack_begin(items: list[tuple[int, int, episode_lib.Episode]], *, length: int,
               num_slots: int, max_new_tokens: int, pad_id: int,
               stop_mask_fn: Callable[[object], np.ndarray]) -> BeginBatch:
  """Packs `(slot, first chunk column, episode)` into one `begin_prefill`
  (see `pack`; each context from column 0)."""
  r = engine_config.row_bucket(len(items), num_slots)
  padded = items + [items[-1]] * (r - len(items))
  episodes = [episode for *_, episode in padded]
  contexts = [e.context_ids() for e in episodes]
  ends = np.array([len(c) for c in contexts], np.int32)
  ending = lambda sequences, fill, dtype: _ending_at(sequences, ends, length, fill, dtype)
  tokens, token_mask = ending(contexts, pad_id, np.int32)
  logprobs, _ = ending([e.open_logprobs for e in episodes], 0.0, np.float32)
  versions, _ = ending([e.open_versions for e in episodes], sampling.NO_VERSION, np.int32)
  return BeginBatch(
      slots=np.array([slot for slot, *_ in padded], np.int32), tokens=tokens,
      token_mask=token_mask, logprobs=logprobs, versions=versions,
      **_segment_fields(episodes, max_new_tokens, stop_mask_fn), context_len=ends,
      open_len=np.array([len(e.open_tokens) for e in episodes], np.int32),
      first=np.array([first for _, first, _ in padded], np.int32))


def _ending_at(sequences, ends: np.ndarray, width: int, fill, dtype):
  """`(values [R, width], mask [R, width])`: row i holds sequence i in the
  columns just before `ends[i]` (`rows.left_pad` to a per-row width)."""
  values = np.full((len(sequences), width), fill, dtype)
  mask = np.zeros((len(sequences), width), bool)
  for i, (sequence, end) in enumerate(zip(sequences, ends)):
    if len(sequence):
      values[i, end - len(sequence):end] = sequence
      mask[i, end - len(sequence):end] = True
  return values, mask


def abstract_begin(rows: int, length: int, num_stop_ids: int) -> BeginBatch:
  """The shapes `pack_begin` gives a batch of `rows` rows (see `abstract`)."""
  row = lambda dtype: jax.ShapeDtypeStruct((rows,), dtype)
  grid = lambda dtype: jax.ShapeDtypeStruct((rows, length), dtype)
  return BeginBatch(
      slots=row(np.int32), tokens=grid(np.int32), token_mask=grid(np.bool_),
      logprobs=grid(np.float32), versions=grid(np.int32),
      key_ids=jax.ShapeDtypeStruct((rows, 3), np.uint32), max_new=row(np.int32),
      stop_mask=jax.ShapeDtypeStruct((rows, num_stop_ids), np.bool_),
      context_len=row(np.int32),
      open_len=row(np.int32), first=row(np.int32))


def _segment_fields(episodes, max_new_tokens: int, stop_mask_fn) -> dict:
  """`key_ids`, `max_new` and `stop_mask` of the segments `episodes` start."""
  return dict(
      key_ids=token_draw.key_ids([e.request.key_id for e in episodes],
                                 [e.sample_index for e in episodes],
                                 [e.turns for e in episodes]),
      max_new=np.array([e.budget_left(max_new_tokens) for e in episodes], np.int32),
      stop_mask=np.stack([stop_mask_fn(e.request) for e in episodes]))


def abstract_fork(rows: int, num_stop_ids: int) -> ForkBatch:
  """The shapes `pack_fork` gives a batch of `rows` rows (see `abstract`)."""
  row = lambda dtype: jax.ShapeDtypeStruct((rows,), dtype)
  return ForkBatch(src=row(np.int32), dst=row(np.int32),
                   key_ids=jax.ShapeDtypeStruct((rows, 3), np.uint32), max_new=row(np.int32),
                   stop_mask=jax.ShapeDtypeStruct((rows, num_stop_ids), np.bool_))


def abstract(rows: int, bucket: int, num_stop_ids: int) -> InsertBatch:
  """The shapes and dtypes `pack` gives a batch of `rows` rows (a row bucket)
  in a bucket of `bucket` columns, as `jax.ShapeDtypeStruct`s (host arrays:
  no sharding), for `SamplerFns.insert_from_ids.lower`."""
  row = lambda dtype: jax.ShapeDtypeStruct((rows,), dtype)
  grid = lambda dtype: jax.ShapeDtypeStruct((rows, bucket), dtype)
  return InsertBatch(
      slots=row(np.int32), tokens=grid(np.int32), mask=grid(np.bool_),
      key_ids=jax.ShapeDtypeStruct((rows, 3), np.uint32), max_new=row(np.int32),
      stop_mask=jax.ShapeDtypeStruct((rows, num_stop_ids), np.bool_), open_len=row(np.int32),
      open_logprobs=grid(np.float32), open_versions=grid(np.int32))
