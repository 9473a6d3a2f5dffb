r"""Runs a grid of config overrides as local subprocesses and tabulates the results.

  python -m launch.local_sweep --config=configs/arith.py --workdir=/tmp/sweep \
      --sweep=orchestrator.max_off_policy_steps=0,2,8 --sweep=learner.lr=1e-4,3e-4 \
      --parallel=1
  python -m launch.local_sweep --config=configs/arith.py:tiny --workdir=/tmp/sweep \
      --from_config   # the config's own get_sweep (arl_jax/config/sweep.py)

Each point runs `python -m arl_jax.launch` with its own workdir
(`<workdir>/<name>`); `--parallel` bounds how many run at once. When all are
done, the final RL metrics and the last held-out evaluation of each point are
written to `<workdir>/summary.md` and `<workdir>/summary.csv`. A failed point
is reported with its exit code and the tail of its log, and does not stop the
others.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time

SUMMARY_KEYS = ("step", "version", "reward_mean", "lag_mean", "tokens_per_s", "drop_rate",
                "wall_s")


@dataclasses.dataclass(frozen=True)
class Point:
  name: str
  overrides: tuple[tuple[str, str], ...]


def parse_sweep(specs: list[str]) -> list[tuple[str, list[str]]]:
  """`["a.b=1,2", "c=x", "d=(4,8),(8,16)"]` -> `[("a.b", ["1", "2"]), ("c", ["x"]),
  ("d", ["(4,8)", "(8,16)"])]`: values are split at commas outside brackets,
  so a tuple or list is one value."""
  axes = []
  for spec in specs:
    key, sep, values = spec.partition("=")
    if not sep or not key or not values:
      raise ValueError(f"--sweep={spec!r}: expected KEY=V1,V2,...")
    axes.append((key.strip(), _split_values(values, spec)))
  return axes


def _split_values(values: str, spec: str) -> list[str]:
  closing = {"(": ")", "[": "]", "{": "}"}
  parts, start, open_brackets = [], 0, []
  for i, char in enumerate(values):
    if char in closing:
      open_brackets.append(closing[char])
    elif char in closing.values():
      if not open_brackets or open_brackets.pop() != char:
        raise ValueError(f"--sweep={spec!r}: unbalanced {char!r} at value character {i}")
    elif char == "," and not open_brackets:
      parts.append(values[start:i])
      start = i + 1
  if open_brackets:
    raise ValueError(f"--sweep={spec!r}: {open_brackets[-1]!r} missing")
  parts.append(values[start:])
  if not all(p.strip() for p in parts):
    raise ValueError(f"--sweep={spec!r}: an empty value (expected KEY=V1,V2,...)")
  return [p.strip() for p in parts]


def expand(axes: list[tuple[str, list[str]]]) -> list[Point]:
  """The Cartesian product of the sweep axes, each point with a readable name."""
  keys = [k for k, _ in axes]
  points = []
  for values in itertools.product(*(v for _, v in axes)):
    overrides = tuple(zip(keys, values))
    # Full dotted keys: `learner.lr` and `warmup.lr` must not share a workdir.
    name = ",".join(f"{k}={v}" for k, v in overrides) or "default"
    points.append(Point(name=name, overrides=overrides))
  return points


def config_points(config: str) -> list[Point]:
  """The points of the config file's own `get_sweep` (see `arl_jax/config/sweep.py`)."""
  from arl_jax.config import sweep  # noqa: PLC0415 - only when asked for

  return [Point(name=sweep.name_of(p), overrides=tuple((k, str(v)) for k, v in p.items()))
          for p in sweep.from_config(config)]


def combine(first: list[Point], second: list[Point]) -> list[Point]:
  """Every point of `first` with every point of `second` (which may not set a
  key `first` sets: the runs named for both values would be the same run)."""
  shared = sorted({k for p in first for k, _ in p.overrides}
                  & {k for p in second for k, _ in p.overrides})
  if shared:
    raise ValueError(f"{', '.join(shared)}: set by both the config's sweep and --sweep; "
                     "sweep each key in one place")
  return [Point(name=",".join(n for n in (a.name, b.name) if n != "default") or "default",
                overrides=a.overrides + b.overrides) for a in first for b in second]


def command(config: str, workdir: str, point: Point) -> list[str]:
  return [sys.executable, "-m", "arl_jax.launch", f"--config={config}", f"--workdir={workdir}",
          *(f"--config.{k}={v}" for k, v in point.overrides)]


def summarize(workdir: str) -> dict:
  """Last RL record and last evaluation from a run's metrics.jsonl."""
  path = os.path.join(workdir, "metrics.jsonl")
  summary: dict = {}
  if not os.path.exists(path):
    return summary
  with open(path, encoding="utf-8") as f:
    for line in f:
      record = json.loads(line)
      if record.get("phase") == "rl" and "loss" in record:
        summary.update({k: record[k] for k in SUMMARY_KEYS if k in record})
      if "eval_reward" in record and record["eval_reward"] is not None:
        summary["eval_reward"] = record["eval_reward"]
  return summary


def run_sweep(config: str, root: str, points: list[Point], parallel: int, log=print) -> list[dict]:
  os.makedirs(root, exist_ok=True)
  pending, running, rows = list(points), [], []
  while pending or running:
    while pending and len(running) < parallel:
      point = pending.pop(0)
      workdir = os.path.join(root, point.name)
      os.makedirs(workdir, exist_ok=True)
      log_file = open(os.path.join(workdir, "log.txt"), "w", encoding="utf-8")  # noqa: SIM115
      proc = subprocess.Popen(command(config, workdir, point), stdout=log_file,
                              stderr=subprocess.STDOUT)
      running.append((point, workdir, proc, log_file, time.monotonic()))
      log(f"started {point.name}")
    for item in list(running):
      point, workdir, proc, log_file, start = item
      if proc.poll() is None:
        continue
      log_file.close()
      running.remove(item)
      row = {"name": point.name, **dict(point.overrides), "exit_code": proc.returncode,
             "seconds": round(time.monotonic() - start, 1), **summarize(workdir)}
      if proc.returncode:
        with open(os.path.join(workdir, "log.txt"), encoding="utf-8") as f:
          row["error"] = f.read()[-500:].replace("\n", " ")
      rows.append(row)
      log(f"finished {point.name}: exit {proc.returncode}")
    time.sleep(0.2)
  rows.sort(key=lambda r: [p.name for p in points].index(r["name"]))
  _write_tables(root, rows)
  return rows


def _write_tables(root: str, rows: list[dict]) -> None:
  columns = list(dict.fromkeys(k for row in rows for k in row if k != "error"))
  with open(os.path.join(root, "summary.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
  with open(os.path.join(root, "summary.md"), "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description="Local sweep over config overrides.")
  parser.add_argument("--config", required=True, help="configs/NAME.py[:ARG]")
  parser.add_argument("--workdir", required=True, help="root folder of the sweep")
  parser.add_argument("--sweep", action="append", default=[], help="KEY=V1,V2 (repeatable)")
  parser.add_argument("--from_config", action="store_true",
                      help="run the config file's get_sweep() points (times any --sweep axes)")
  parser.add_argument("--parallel", type=int, default=1)
  args = parser.parse_args(argv)
  if args.parallel < 1:
    parser.error("--parallel must be >= 1")
  try:
    points = expand(parse_sweep(args.sweep))
    if args.from_config:
      points = combine(config_points(args.config), points)
  except ValueError as e:
    parser.error(str(e))
  rows = run_sweep(args.config, args.workdir, points, args.parallel)
  with open(os.path.join(args.workdir, "summary.md"), encoding="utf-8") as f:
    print(f.read())
  return 1 if any(r["exit_code"] for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
