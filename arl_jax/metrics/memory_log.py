"""A run's `memory.jsonl`: at the end of each phase, its host peak and who holds what.

One row per phase a run goes through (the start-up's phases, each update,
each evaluation, each checkpoint, the stop): `phase`, `step` (the version
then), `peak_bytes` (the resident host peak over the phase: `host_memory`'s
window since the previous row), and the ledger's account at the phase's end
(`memory_ledger.Account.record`: live device bytes by owner, the busiest
device's, the host's resident size). `benchmarks/memory.py` prints these
rows as a table; `--dry_run`'s plan is checked against them.

The log owns no peak windows of its own: it takes those of the run's
`PeakWindows` (one owner per process), so each update's `host_peak_gib`
is the largest window noted since the previous update's row (`row_peak`).
"""

from __future__ import annotations

import time

from arl_jax.metrics import host_memory, memory_ledger


class MemoryLog:

  def __init__(self, ledger: memory_ledger.Ledger, windows: host_memory.PeakWindows,
               release: bool = True):
    """Args:
      ledger: what the run's components declared they hold.
      windows: the run's peak windows (the startup clock's).
      release: at each phase's end, return what the process freed to the
        system (`host_memory.release_free`) before the account, so that the
        next phase starts from what is held (`release_host_memory`).
    """
    self.ledger = ledger
    self.release = release
    self._windows = windows
    self._write = None
    self._waiting: list[dict] = []  # rows noted before `open` (the imports')
    self._row_peak: int | None = None

  def open(self, write_fn) -> None:
    """Rows go to `write_fn` (`memory.jsonl`'s writer) from now on, the
    ones noted before first (the log exists before the run's folder does)."""
    self._write = write_fn
    for row in self._waiting:
      write_fn(row)
    self._waiting = []

  def note(self, phase: str, step: int | None = None) -> int | None:
    """Ends `phase` (its peak window taken now) and writes its row; returns
    the window's peak."""
    peak = self._windows.take()
    if peak is not None:
      self._row_peak = max(self._row_peak or 0, peak)
    release_s = None
    start = time.perf_counter()
    if self.release and host_memory.release_free():
      release_s = round(time.perf_counter() - start, 4)
    row = {"phase": phase, "step": step, "peak_bytes": peak, **self.ledger.account().record(),
           "release_s": release_s}
    if self._write is None:
      self._waiting.append(row)
    else:
      self._write(row)
    return peak

  def release_free(self) -> None:
    """Returns what the process freed to the system now, between phases
    too, where `release` asks for it (after a checkpoint's write, whose
    buffers would otherwise stay with the process under the next update)."""
    if self.release:
      host_memory.release_free()

  def row_peak(self) -> int | None:
    """The largest window noted since the last call (an update's
    `host_peak_gib`), then starts over."""
    peak, self._row_peak = self._row_peak, None
    return peak
