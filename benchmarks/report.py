"""Output of every benchmark: a Markdown-style table on stdout, JSON lines on
disk; and the median timer they share."""

from __future__ import annotations

import json
import os
import statistics
import time


def print_table(rows: list[dict], title: str | None = None,
                skip: tuple[str, ...] = ("benchmark", "part")) -> None:
  """Prints `rows` as a `|`-separated table with the union of their keys as columns."""
  columns = list(dict.fromkeys(k for r in rows for k in r if k not in skip))
  if title:
    print(f"## {title}")
  print(" | ".join(columns))
  for r in rows:
    print(" | ".join(str(r.get(c, "")) for c in columns))
  print()


def append_jsonl(rows: list[dict], path: str | None) -> None:
  """Appends one JSON object per row to `path` (nothing when path is None)."""
  if not path:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def median_seconds(fn, repeats: int) -> float:
  """Median wall seconds of `fn()` over `repeats` calls, after one uncounted
  call (compiles, first page faults). `fn` must wait for its own result
  (`jax.block_until_ready` for device work)."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)
