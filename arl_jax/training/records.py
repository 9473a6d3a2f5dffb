"""The run's JSON-lines records follow the checkpoint a run resumes from.

`metrics.jsonl` (one row per update, evaluation, warm-up log) and
`groups.jsonl` (what happened to every group) describe one line of work. A
run that stops without a final save and resumes from an earlier checkpoint
redoes the updates since that checkpoint; a run that left no checkpoint at all
(stopped during warm-up, or before its first save) starts over. Their rows
would then appear twice. So a checkpoint records how many lines each file had
when it was taken (`positions`), and before a run writes anything it keeps
exactly that many lines of each file and moves the rest, a torn last line
included, to `<name>.superseded.jsonl` (nothing is deleted), after a marker
line saying why. A fresh start keeps none.
"""

from __future__ import annotations

import json
import os
import time

# (`schedule.jsonl`: a run with `replay.record`, `core/schedule.py`)
FILES = ("metrics.jsonl", "groups.jsonl", "schedule.jsonl")


def superseded_path(path: str) -> str:
  stem, ext = os.path.splitext(path)
  return f"{stem}.superseded{ext}"


def keep_lines(path: str, keep: int, reason: str) -> int:
  """Keeps the first `keep` complete lines of the JSON-lines file at `path`
  and appends the rest to its `.superseded.jsonl` file. Returns how many
  lines were moved (a torn last line counts as one)."""
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    lines = f.read().splitlines(keepends=True)
  kept = [line for line in lines[:keep] if line.endswith(b"\n")]
  moved = lines[len(kept):]
  if not moved:
    return 0
  with open(superseded_path(path), "ab") as f:
    marker = {"superseded": len(moved), "reason": reason, "time": time.time()}
    f.write(json.dumps(marker).encode() + b"\n")
    f.writelines(line if line.endswith(b"\n") else line + b"\n" for line in moved)
    f.flush()
    os.fsync(f.fileno())
  # Replaced in one rename: a kill here leaves the old file or the new one.
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.writelines(kept)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return len(moved)


def reconcile(log_dir: str, positions: dict | None, reason: str) -> dict[str, int]:
  """Trims each of `FILES` in `log_dir` to `positions[name]` lines (None: a
  fresh start, keep none). Returns `{name: lines moved}` for the files that
  changed."""
  moved = {}
  for name in FILES:
    keep = 0 if positions is None else int(positions.get(name, 0))
    count = keep_lines(os.path.join(log_dir, name), keep, reason)
    if count:
      moved[name] = count
  return moved


def describe(moved: dict[str, int], log_dir: str) -> str:
  return ", ".join(f"{count} line(s) of {name} -> "
                   f"{os.path.basename(superseded_path(os.path.join(log_dir, name)))}"
                   for name, count in moved.items())


def reconcile_and_report(log_dir: str, positions: dict | None, *, reason: str, print_fn) -> None:
  """`reconcile`, saying what was set aside."""
  moved = reconcile(log_dir, positions, reason)
  if moved:
    print_fn(f"set aside records written after the point this run starts from: "
             f"{describe(moved, log_dir)}")


def step_rows(log_dir: str, first_step: int = 0) -> list[dict]:
  """The update rows (`phase: rl` with a loss) of `metrics.jsonl` from update
  `first_step` on: what a run returns as its history (read back from disk, so
  that a long run does not also hold every row in memory)."""
  path = os.path.join(log_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      if row.get("phase") == "rl" and "loss" in row and row["step"] >= first_step:
        rows.append({k: v for k, v in row.items() if k != "phase"})
  return rows
