"""Where the time before the first update went: the phases of a run's start.

A run can spend minutes before its first update (importing JAX, building or
restoring the model, the supervised warm-up, the first evaluation, compiling
every sampler program), and a user watching it cannot tell a slow compile
from a hang. The run loop marks the end of each phase on its own (the main)
thread; the first progress line then says, e.g.,
`startup 41.3 s: import 2.9, build 1.6, warm-up 20.8, eval 3.1, compile 12.9;
host peak 3.2 GiB (compile)`, and the first update's `metrics.jsonl` row holds
`startup_<phase>_s` and `startup_<phase>_peak_gib`: each phase's resident
host-memory peak (`host_memory.py`), which on a CPU backend is where the
devices' memory lives too.
"""

from __future__ import annotations

import time

from arl_jax.metrics import host_memory


class StartupClock:
  """Seconds per phase, in the order the phases first ended."""

  def __init__(self, started_at: float | None = None, clock=time.monotonic,
               memory: host_memory.PeakWindows | None = None, programs=None, memory_log=None):
    """Args:
      started_at: `clock()` when the process began its work (the launcher's
        first line): the time until now is the `import` phase. None: the
        clock starts now (`run` called from a notebook or a test).
      clock: seconds, monotonic.
      memory: the process's peak windows (None: new ones); after the start-up
        the learner loop takes one window per update from the same object.
      programs: an open `compile_cache.ProgramCounter` (None: not counted):
        the summary then says how many programs were built by then, and how
        many the persistent compilation cache supplied.
      memory_log: the run's `memory_log.MemoryLog` over the same `memory`
        (None: none): each phase's end is noted there too.
    """
    self._clock = clock
    self._last = clock()
    self._seconds: dict[str, float] = {}
    self._peaks: dict[str, int] = {}
    self.memory = host_memory.PeakWindows() if memory is None else memory
    self._programs = programs
    self._memory_log = memory_log
    if started_at is not None:
      self._seconds["import"] = max(self._last - started_at, 0.0)
      self._note_peak("import")

  def _note_peak(self, phase: str) -> None:
    peak = self.memory.take() if self._memory_log is None else self._memory_log.note(phase)
    if peak is not None:
      self._peaks[phase] = max(self._peaks.get(phase, 0), peak)

  def mark(self, phase: str) -> None:
    """Ends `phase` now: the time since the last mark is added to it, and
    the host-memory peak since then counts as its peak."""
    now = self._clock()
    self._seconds[phase] = self._seconds.get(phase, 0.0) + now - self._last
    self._last = now
    self._note_peak(phase)

  @property
  def total(self) -> float:
    return sum(self._seconds.values())

  def summary(self) -> str:
    """`startup 41.3 s: import 2.9, build 1.6, ...; 57 programs (0 from the
    cache); host peak 3.2 GiB (compile)` (phases under 0.05 s left out; the
    programs when counted; the peak where the platform measures it)."""
    parts = [f"{name} {s:.1f}" for name, s in self._seconds.items() if s >= 0.05]
    line = f"startup {self.total:.1f} s: {', '.join(parts)}"
    if self._programs is not None:
      line += f"; {self._programs.summary()}"
    if self._peaks:
      phase = max(self._peaks, key=self._peaks.get)
      line += f"; host peak {self._peaks[phase] / 1024**3:.1f} GiB ({phase})"
    return line

  def record(self) -> dict[str, float]:
    """`{"startup_<phase>_s": seconds, "startup_<phase>_peak_gib": GiB, ...,
    "startup_s": total}` for a metrics row."""
    row = {f"startup_{name.replace('-', '')}_s": round(s, 3) for name, s in self._seconds.items()}
    row.update({f"startup_{name.replace('-', '')}_peak_gib": host_memory.gib(peak)
                for name, peak in self._peaks.items()})
    if self._programs is not None:
      row.update(startup_programs=self._programs.programs,
                 startup_programs_from_cache=self._programs.from_cache)
    row["startup_s"] = round(self.total, 3)
    return row
