"""The process's host memory: resident now, and its peak over a window.

On a CPU backend the devices' arrays, XLA's temporaries and the compiler's own
working memory are all host memory, so the resident peak is what decides
whether a run fits the machine; `--dry_run` plans only the arrays. Linux keeps
the peak (`VmHWM` in `/proc/self/status`) and lets a process reset it (writing
5 to `/proc/self/clear_refs`), so a window's peak, e.g. one start-up phase's,
is measured exactly, whatever thread allocated it. Elsewhere only the peak
since the process began is known (`resource.getrusage`), and windows report
that.
"""

from __future__ import annotations

import re
import sys

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_GIB = 1024**3


def _status_kib(field: str) -> int | None:
  try:
    with open(_STATUS) as f:
      match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
  except OSError:
    return None
  return None if match is None else int(match.group(1))


def resident_bytes() -> int | None:
  """Resident set size now; None where the platform does not say."""
  kib = _status_kib("VmRSS")
  return None if kib is None else kib * 1024


def peak_bytes() -> int | None:
  """The resident peak since the process began or the last `reset_peak`."""
  kib = _status_kib("VmHWM")
  if kib is not None:
    return kib * 1024
  try:
    import resource  # noqa: PLC0415  (not on Windows)
  except ImportError:
    return None
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak if sys.platform == "darwin" else peak * 1024  # (bytes on macOS, KiB on Linux)


def reset_peak() -> bool:
  """Starts a new peak window at the current resident size; False where the
  platform cannot (then `peak_bytes` keeps the whole process's peak)."""
  try:
    with open(_CLEAR_REFS, "w") as f:
      f.write("5")
  except OSError:
    return False
  return True


class PeakWindows:
  """Peaks of consecutive windows of one process: `take()` returns the peak
  since the previous `take()` (or construction) and opens the next window.

  One owner per process: each `take` resets the kernel's peak, so two
  owners would cut each other's windows short.
  """

  def __init__(self):
    self.resettable = reset_peak()
    self._overall: int | None = None

  def take(self) -> int | None:
    """Bytes: the resident peak of the window that ends now."""
    peak = peak_bytes()
    if self.resettable:
      reset_peak()
    if peak is not None:
      self._overall = max(self._overall or 0, peak)
    return peak

  @property
  def overall(self) -> int | None:
    """The largest peak of the windows taken so far (the process's peak since
    the first window opened, once the last one is taken); the kernel's own
    count (`getrusage`) no longer says it, since the windows reset it."""
    return self._overall


_libc = None


def release_free() -> bool:
  """Returns the memory freed inside the process to the system (glibc's
  `malloc_trim(0)`, every arena); False where the C library has no such call.

  On a CPU backend a compiled program's temporaries are malloc'd and freed
  by XLA's threads each run; glibc keeps what they freed in per-thread
  arenas, and phases on other threads (the sampler, the evaluation, a
  checkpoint's writer) cannot reuse it: measured on SmolLM2-135M, the
  resident size between updates grew to 6x the live arrays over six
  updates (`benchmarks/memory.py`).
  """
  global _libc
  if _libc is None:
    try:
      import ctypes  # noqa: PLC0415

      _libc = ctypes.CDLL("libc.so.6")
      _libc.malloc_trim  # noqa: B018  (glibc only: musl, macOS have none)
    except (OSError, AttributeError):
      _libc = False
  if not _libc:
    return False
  _libc.malloc_trim(0)
  return True


def gib(num_bytes: int | None) -> float | None:
  return None if num_bytes is None else round(num_bytes / _GIB, 3)
