r"""Where two runs part: `python -m arl_jax.diff RUN_A RUN_B`.

Reads each run's `metrics.jsonl` (and `schedule.jsonl`, when both runs
recorded one: `replay.record=True`) and prints the first row where they
differ and what differed: for an update, which of its inputs (the batch's
token versions, its tokens) or its result (the params hash, then the logged
numbers); with schedules, also the first decision of the sampler engine and
of the learner that differs (the groups started, the swap points, the
cancellations, the cuts). Numbers that depend on the clock (times, rates,
what a concurrent thread had done when a row was written) are not compared:
`VOLATILE`, `VOLATILE_PREFIXES`, and seconds (`..._s`, `..._seconds`).

Exit status: 0 identical, 1 different, 2 bad input (a missing run or file,
a line that is not JSON), with one `error:` line and no traceback.
"""

from __future__ import annotations

import json
import os
import sys

from arl_jax.core import schedule as schedule_lib

# Row keys that follow the clock, not the computation.
VOLATILE = frozenset({
    "seconds_in_flight", "seconds_in_buffer", "learner_busy_fraction", "host_peak_gib",
    "buffer_size", "in_system_groups", "checkpoint_blocking_s_total", "time",
    # (the sampler's counts so far when the row is written: a publish's
    # cancellations reach them at the engine's next iteration, before or after)
    "cancelled_tokens_discarded", "cancelled_tokens_saved_max"})
VOLATILE_PREFIXES = ("sampler_", "startup_", "env_")
_SECONDS = ("_s", "_seconds")


class DiffError(ValueError):
  """A run or file that cannot be compared."""


def comparable(row: dict) -> dict:
  """`row` without its clock-dependent keys."""
  return {k: v for k, v in row.items() if k not in VOLATILE
          and not k.startswith(VOLATILE_PREFIXES) and not k.endswith(_SECONDS)}


def read_rows(run_dir: str) -> list[dict]:
  """The rows of `run_dir/metrics.jsonl` that have a step (warm-up, updates,
  evaluations), in order. A torn last line (a killed run's) is left out."""
  if not os.path.isdir(run_dir):
    raise DiffError(f"{run_dir}: no such run folder")
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise DiffError(f"{path}: missing (not a run's workdir?)")
  rows = []
  for number, line in enumerate(schedule_lib.complete_lines(path), 1):
    try:
      row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
      raise DiffError(f"{path}:{number}: not a JSON line: {line[:60]!r}") from None
    if isinstance(row, dict) and "step" in row:
      rows.append(row)
  return rows


def _label(row: dict) -> str:
  phase = row.get("phase", "?")
  if phase == "rl" and "version" in row:
    return f"update {row['step']} (version {row['version']})"
  return f"{phase} step {row['step']}"


def first_row_difference(a: list[dict], b: list[dict]) -> str | None:
  """The first row that differs (its label and up to 5 keys), or None."""
  for x, y in zip(a, b):
    x, y = comparable(x), comparable(y)
    if x != y:
      keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
      shown = ", ".join(f"{k}: {x.get(k)!r} vs {y.get(k)!r}" for k in keys[:5])
      more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
      return f"{_label(x)}: {shown}{more}"
  if len(a) != len(b):
    shorter, longer = ("A", b) if len(a) < len(b) else ("B", a)
    return f"{_label(longer[min(len(a), len(b))])}: run {shorter} has no such row"
  return None


def _streams(run_dir: str) -> dict[str, list[dict]] | None:
  """A run's schedule as three streams (engine, learner, updates), or None
  when it recorded none."""
  if not os.path.isfile(os.path.join(run_dir, schedule_lib.FILE)):
    return None
  try:
    events = schedule_lib.read_events(run_dir)
  except schedule_lib.ScheduleError as e:
    raise DiffError(str(e)) from None
  streams = {"engine": [], "learner": [], "update": []}
  for event in events:
    kind = event["e"]
    if kind == "update":
      streams["update"].append(event)
    elif kind in ("take", "cancel", "offer", "pause"):
      streams["engine"].append(event)
    elif kind in ("cut", "publish", "save", "eval", "segment"):
      streams["learner"].append(event)
  return streams


def _event(event: dict) -> str:
  return f"{event['e']} " + " ".join(f"{k}={v}" for k, v in event.items() if k != "e")


def schedule_differences(a: str, b: str) -> list[str]:
  """What differs first in each stream of two runs' schedules (empty when
  either recorded none, or they agree)."""
  sa, sb = _streams(a), _streams(b)
  if sa is None or sb is None:
    return []
  found = []
  for x, y in zip(sa["update"], sb["update"]):
    for key, what in (("ver", "the batch's token versions"), ("tok", "the batch's tokens"),
                      ("par", "the params hash after it")):
      if x[key] != y[key]:
        found.append(f"update {x['u']}: {what} differ ({x[key]} vs {y[key]})")
        break
    if found:
      break
  for name, what in (("engine", "sampler decision"), ("learner", "learner decision")):
    for i, (x, y) in enumerate(zip(sa[name], sb[name])):
      if x != y:
        found.append(f"first {what} that differs (#{i}): {_event(x)} vs {_event(y)}")
        break
  return found


def diff(a: str, b: str) -> tuple[bool, list[str]]:
  """`(identical, lines to print)` for runs `a` and `b`."""
  rows_a, rows_b = read_rows(a), read_rows(b)
  first = first_row_difference(rows_a, rows_b)
  lines = schedule_differences(a, b)
  if first is None and not lines:
    updates = sum(1 for r in rows_a if r.get("phase") == "rl" and "loss" in r)
    return True, [f"identical: {len(rows_a)} rows ({updates} updates), clock-dependent "
                  f"numbers aside"]
  return False, ([f"first difference: {first}"] if first else []) + lines


_USAGE = ("usage: python -m arl_jax.diff RUN_A RUN_B  (two runs' workdirs; --help: this)\n"
          "Prints the first update where the runs differ and what differed; exit status 0 "
          "identical, 1 different, 2 bad input.")


def main(argv: list[str]) -> int:
  if argv in (["--help"], ["-h"]):
    print(_USAGE)
    return 0
  if len(argv) != 2 or any(arg.startswith("-") for arg in argv):
    print(_USAGE, file=sys.stderr)
    return 2
  try:
    identical, lines = diff(*argv)
  except (DiffError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for line in lines:
    print(line)
  return 0 if identical else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
