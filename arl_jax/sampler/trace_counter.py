"""Counting how often JAX traces a function: the public way to check compiles.

Under `jax.jit` the Python body of a function runs only while JAX traces it,
once for every new combination of argument shapes, dtypes and static values;
each trace is compiled. A counter bumped in the body therefore counts those
compiles without reading JAX's private caches. (A call whose only change is
the sharding of an argument compiles again from the cached trace and is not
counted: the jitted functions here pin their output shardings so that the
state they pass along never changes layout.)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable


class TraceCounter:
  """Counts the traces of the functions it wraps (all of them together)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._count = 0

  @property
  def count(self) -> int:
    """Traces so far."""
    with self._lock:
      return self._count

  def wrap(self, fn: Callable) -> Callable:
    """`fn`, counting each call; jit the result, and each call is a trace."""

    @functools.wraps(fn)
    def counted(*args, **kwargs):
      # Engine and learner threads may trace at the same time.
      with self._lock:
        self._count += 1
      return fn(*args, **kwargs)

    return counted
