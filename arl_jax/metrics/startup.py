"""Where the time before the first update went: the phases of a run's start.

A run can spend minutes before its first update (importing JAX, building or
restoring the model, the supervised warm-up, the first evaluation, compiling
every sampler program), and a user watching it cannot tell a slow compile
from a hang. The run loop marks the end of each phase on its own (the main)
thread; the first progress line then says, e.g.,
`startup 41.3 s: import 2.9, build 1.6, warm-up 20.8, eval 3.1, compile 12.9`,
and the first update's `metrics.jsonl` row holds `startup_<phase>_s`.
"""

from __future__ import annotations

import time


class StartupClock:
  """Seconds per phase, in the order the phases first ended."""

  def __init__(self, started_at: float | None = None, clock=time.monotonic):
    """Args:
      started_at: `clock()` when the process began its work (the launcher's
        first line): the time until now is the `import` phase. None: the
        clock starts now (`run` called from a notebook or a test).
      clock: seconds, monotonic.
    """
    self._clock = clock
    self._last = clock()
    self._seconds: dict[str, float] = {}
    if started_at is not None:
      self._seconds["import"] = max(self._last - started_at, 0.0)

  def mark(self, phase: str) -> None:
    """Ends `phase` now: the time since the last mark is added to it."""
    now = self._clock()
    self._seconds[phase] = self._seconds.get(phase, 0.0) + now - self._last
    self._last = now

  @property
  def total(self) -> float:
    return sum(self._seconds.values())

  def summary(self) -> str:
    """`startup 41.3 s: import 2.9, build 1.6, ...` (phases under 0.05 s left out)."""
    parts = [f"{name} {s:.1f}" for name, s in self._seconds.items() if s >= 0.05]
    return f"startup {self.total:.1f} s: {', '.join(parts)}"

  def record(self) -> dict[str, float]:
    """`{"startup_<phase>_s": seconds, ..., "startup_s": total}` for a metrics row."""
    row = {f"startup_{name.replace('-', '')}_s": round(s, 3) for name, s in self._seconds.items()}
    row["startup_s"] = round(self.total, 3)
    return row
