"""Metric sinks: JSON lines in the workdir (always) and a one-line progress print."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping


def _jsonable(value):
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


class JsonlWriter:
  """Appends one JSON object per call to `<workdir>/metrics.jsonl`."""

  def __init__(self, workdir: str, filename: str = "metrics.jsonl"):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, filename)
    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

  def write(self, record: Mapping) -> None:
    self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def progress_line(record: Mapping) -> str:
  """`step 12 | v12 | reward 0.410 | lag 0.92/1 (queue 0.10) | 1200 tok/s | drops 3.1%
  s24 c8 e0 t0 | ...`, plus eval. Drops are cumulative rollouts by reason: stale,
  cancelled in flight, env error, truncated (masked)."""
  parts = [
      f"step {record['step']:>4d}",
      f"v{record['version']}",
      f"reward {record['reward_mean']:.3f}",
      f"lag {record['lag_mean']:.2f}/{record['lag_max']:d} "
      f"(queue {record['lag_in_queue_mean']:.2f})",
      f"{record['tokens_per_s']:.0f} tok/s",
      f"drops {100 * record['drop_rate']:.1f}% s{record['dropped_stale']:d} "
      f"c{record['dropped_cancelled']:d} e{record['dropped_env_error']:d} "
      f"t{record['dropped_truncated']:d}",
      f"loss {record['loss']:+.4f}",
      f"ratio max {record['ratio_max']:.3f}",
  ]
  if "eval_reward" in record:
    parts.append(f"eval {record['eval_reward']:.3f}")
  return " | ".join(parts)


def print_line(line: str) -> None:
  print(line, file=sys.stdout, flush=True)
