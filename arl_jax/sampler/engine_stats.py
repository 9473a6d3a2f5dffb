"""`EngineStats`: the sampler engine's counters and the metrics they give."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class EngineStats:
  """Counters; seconds are wall time of the engine thread."""

  steps: int = 0
  inserts: int = 0
  resumes: int = 0  # re-admissions of multi-turn episodes (counted in inserts too)
  forked_rows: int = 0  # inserts that started from another row's prefill (shared prompts)
  prefill_chunks: int = 0  # chunked-prefill calls (`prefill_chunk`)
  # Prompt tokens prefilled (a chunk counts its columns; forks none), as the
  # prefill budget counts them (`prefill_budget.py`).
  prefill_tokens: int = 0
  prefill_phases: int = 0  # admissions' prefill phases run (each one or more calls)
  swaps: int = 0
  sampled_tokens: int = 0
  finished_segments: int = 0
  cancelled_rollouts: int = 0
  # Of cancelled rollouts: completion budget left unsampled (the compute
  # cancellation saved, an upper bound: a rollout may have stopped earlier),
  # and tokens already sampled (work thrown away).
  cancelled_tokens: int = 0
  cancelled_sampled_tokens: int = 0
  # A decode counts from its planning (pages, preemptions) to its done flags
  # read; a prefill phase from admission planning to its done flags read.
  decode_seconds: float = 0.0
  prefill_seconds: float = 0.0
  swap_seconds: float = 0.0
  # From a row's ready time (request dispatched, episode handed back, row
  # preempted) to its admission into a slot (its prefill not included).
  queue_wait_seconds: float = 0.0
  occupied_slot_steps: int = 0
  model_passes: int = 0  # decode forwards; > steps when pinned serves several versions
  slot_steps: int = 0
  max_versions_held: int = 1
  precompiled_programs: int = 0  # compiled up front (`EngineConfig.precompile`)
  precompile_seconds: float = 0.0
  # Paged KV cache: slots evicted for lack of pages (re-admitted later with
  # what they sampled), the context tokens prefilled again for them, and the
  # most pages in use at once (of `kv_pages` usable).
  preemptions: int = 0
  preempted_tokens: int = 0
  kv_pages_peak: int = 0
  kv_pages: int = 0
  # The longest wait of a live slot between two decode calls (admissions,
  # prefills, harvests and swaps in between): what a long prefill stalls
  # every decoding slot for (`prefill_chunk` bounds it).
  max_decode_gap_seconds: float = 0.0

  # Fields that are maxima or sizes rather than counts (summing samplers takes their max).
  MAXIMA = ("max_versions_held", "kv_pages_peak", "kv_pages", "max_decode_gap_seconds")

  def count_cancelled(self, row, max_new_tokens: int) -> None:
    """Counts a cancelled `waiting_rows.Row`: its unsampled budget and what it sampled."""
    self.cancelled_rollouts += 1
    budget = row.budget or row.episode.budget_left(max_new_tokens)
    self.cancelled_tokens += max(budget - row.sampled, 0)
    self.cancelled_sampled_tokens += row.sampled

  def count_decode(self, steps: int, num_slots: int, occupied: int, start: float,
                   waited: float | None = None) -> None:
    """Counts a decode call of `steps` steps begun at `start` (`time.monotonic`),
    `waited` seconds after the last call that left a slot decoding (None: none did)."""
    self.steps += steps
    self.slot_steps += steps * num_slots
    self.occupied_slot_steps += steps * occupied
    self.decode_seconds += time.monotonic() - start
    if waited is not None:
      self.max_decode_gap_seconds = max(self.max_decode_gap_seconds, waited)

  @property
  def busy_seconds(self) -> float:
    return self.decode_seconds + self.prefill_seconds + self.swap_seconds

  @property
  def occupancy(self) -> float:
    """Mean fraction of slots holding a live sequence per decode step."""
    return self.occupied_slot_steps / max(self.slot_steps, 1)

  def metrics(self) -> dict:
    """The sampler's numbers in a step record (cumulative)."""
    return {
        # Upper bound: cancelled rollouts' unsampled budget (they might have stopped earlier).
        "cancelled_tokens_saved_max": self.cancelled_tokens,
        "cancelled_tokens_discarded": self.cancelled_sampled_tokens,
        "sampler_resumes": self.resumes,
        "sampler_forked_rows": self.forked_rows,
        "sampler_max_decode_gap_s": self.max_decode_gap_seconds,
        "sampler_prefill_chunks": self.prefill_chunks,
        "sampler_prefill_tokens": self.prefill_tokens,
        "sampler_busy_s": self.busy_seconds,
        "sampler_swaps": self.swaps,
        "sampler_occupancy": self.occupancy,
        "sampler_tokens_per_s": self.sampled_tokens / max(self.busy_seconds, 1e-9),
        "sampler_prefill_s": self.prefill_seconds,
        "sampler_decode_s": self.decode_seconds,
        "sampler_swap_pause_s": self.swap_seconds,
        "sampler_queue_wait_s": self.queue_wait_seconds / max(self.inserts, 1),
        "sampler_versions_held": self.max_versions_held,
        "sampler_precompiled_programs": self.precompiled_programs,
        "sampler_precompile_s": self.precompile_seconds,
        "sampler_preemptions": self.preemptions,
        "sampler_preempted_tokens": self.preempted_tokens,
        "sampler_kv_pages_peak": self.kv_pages_peak,
        "sampler_kv_pages": self.kv_pages,
    }

  # The counters a checkpoint carries (the rest describe this process's time).
  _CHECKPOINTED = ("cancelled_rollouts", "cancelled_tokens", "cancelled_sampled_tokens")

  def state_dict(self) -> dict:
    return {name: getattr(self, name) for name in self._CHECKPOINTED}

  def load_state_dict(self, state: dict) -> None:
    for name in self._CHECKPOINTED:
      setattr(self, name, int(state[name]))
