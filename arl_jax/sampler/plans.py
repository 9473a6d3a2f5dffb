"""What the sampler's scheduler asks of its runner, one engine iteration at a time.

The scheduler (`scheduler.py`, plain Python) decides; the runner
(`runner.py`) executes a plan through the slot functions and reports what the
device produced; the scheduler applies the report. An iteration has two
plans, because the second depends on the first's result (a first token may
end a segment, and a finished slot takes no pages):

- `PrefillPlan`: the page table (paged), then in order the inserts of whole
  contexts, the chunked prefills begun, the forks that start from a fresh
  prefill, and one chunk of every chunked prefill under way (with the forks
  its last chunk lets start). Prefill is a token budget per iteration: a
  chunked prefill is a request scheduled for a chunk of its tokens.
- `DecodePlan`: the segments of the slots preempted for pages (read before
  anything overwrites them), the page table, and the decode calls (one per
  version, per span when paged), the first ending the slots stopped since the
  last decode.

Rows (`waiting_rows.Row`) travel in the plans so that the runner can pack
their episodes; the runner never writes them.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Insert:
  """Prefill contexts that share a `bucket` in one call (`sampling.insert`),
  sampling each one's first token. `items`: `(slot, row)`."""

  version: int
  params: object
  bucket: int
  items: tuple


@dataclasses.dataclass(frozen=True)
class BeginChunks:
  """Put contexts longer than a chunk in their slots (`prefill_chunks.begin`);
  `items`: `(slot, first chunk's start column, row)`."""

  items: tuple


@dataclasses.dataclass(frozen=True)
class Fork:
  """Start rows from the prefill of a row with the same context
  (`sampling.fork`); `items`: `(slot, source slot, row)`."""

  items: tuple


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One chunk of the prefilling `rows` under one version
  (`prefill_chunks.prefill_chunk`); the arrays are padded to a row bucket."""

  version: int
  params: object
  rows: np.ndarray  # [R] int32 slots
  starts: np.ndarray  # [R] int32 first column of each row's chunk
  final: np.ndarray  # [R] bool: the row's last chunk (it samples the first token)
  span: int  # columns the call's attention reads (`EngineConfig.decode_span`)


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  page_table: np.ndarray | None  # the host page table, when the device's is stale
  work: tuple  # Insert, BeginChunks, Fork and Chunk, in the order they run
  start: float  # when it was planned (`time.monotonic`): prefill time counts from here

  def __bool__(self) -> bool:
    return bool(self.work)


@dataclasses.dataclass(frozen=True)
class DecodeCall:
  """`steps` decode steps of the slots `mask` under one version's params.
  Dense: one call over the mask (`slots` None); paged: the `slots` (a row
  bucket, the last repeated) whose attention reads `span` columns."""

  version: int
  params: object
  mask: np.ndarray | None  # [B] bool (None: every slot; free ones are done on the device)
  slots: np.ndarray | None = None
  span: int | None = None


@dataclasses.dataclass(frozen=True)
class DecodePlan:
  preempted: tuple[int, ...]  # slots whose segments to read first (kept by their episodes)
  page_table: np.ndarray | None
  stop: np.ndarray | None  # [B] bool, slots the first call ends on the device (None: none)
  calls: tuple[DecodeCall, ...]
  steps: int
  start: float  # when it was planned (`time.monotonic`): decode time counts from here


@dataclasses.dataclass(frozen=True)
class Recompute:
  """Prefill again every occupied slot's keys and values under new params
  (in-flight `recompute`); `width`: the columns it reads (None: all)."""

  params: object
  occupied: np.ndarray  # [B] bool
  width: int | None
