r"""What recording a run's schedule costs, and what replaying it costs (issue 57).

A run with `replay.record` writes every decision the clock made to
`schedule.jsonl` (`core/schedule.py`): an event per engine admission, weight
offer, cancellation, batch cut and publish, and per update the hashes of the
batch's tokens and versions and a fingerprint of the params
(`models/fingerprint.py`: one jitted reduction, 16 bytes to the host). A
replay (`replay.from_run`) follows those decisions instead of the clock.

Two measurements, side by side in one process:

- `part: "run"`: the arith task (tiny model unless `--full`), `--steps`
  updates, in `--pairs` pairs of one plain and one recorded run (the order
  alternating pair to pair, so drift of a shared machine falls on both),
  after one uncounted run of each kind, then one replay of the last
  recording. Per run: the RL wall time (`rl_s`, from RL's start to the
  last update's end), `steady_s` (the same without the first update),
  `cpu_s` (the process's CPU seconds over the whole run, every thread),
  updates/s and trained tokens/s; `part: "summary"`: the paired ratios.
  On a shared 2-core machine whole runs of a few seconds move by 5-15%
  from one to the next, more than recording costs: read the ratios' spread.
- `part: "cost"`: recording's own work. In the recorded runs, the time
  spent writing events (`Log.write`, on the sampler's and the learner's
  threads) and in the learner's per-update bookkeeping (hashing the batch,
  the params fingerprint from sums fetched with the update's metrics,
  `LearnerLoop._follow_schedule`), timed by wrapping them; `in_run_fraction`
  = their sum / the RL wall time (an upper bound: the two threads overlap).
  Beside it, each piece alone on an idle learner: one event written, one
  fingerprint computed and fetched, one batch hashed (64 rollouts of 64
  tokens).

  python benchmarks/replay.py                      # ~2 min: arith tiny, 3 pairs of 60 updates
  python benchmarks/replay.py --pairs=5 --steps=100 --out=/tmp/replay.jsonl
  python benchmarks/replay.py --full --steps=40    # the arith config's model
  python benchmarks/replay.py --quick              # 1 pair of 8 updates: a check, ~20 s
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import numpy as np

from arl_jax.core import schedule as schedule_lib
from arl_jax.models import fingerprint
from arl_jax.testing import tiny
from arl_jax.training import learner_loop, run_lib
from arl_jax.training import replay as replay_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)


def _config(steps: int, full: bool, **replay_keys):
  config = tiny.load_config("arith", None if full else "tiny")
  config.num_steps = steps
  config.eval_every = 0
  config.log_every = 0
  config.replay.update(**replay_keys)
  return config


def _run_row(kind: str, pair: int, workdir: str, result: run_lib.RunResult,
             cpu_s: float) -> dict:
  history = result.history
  rl_s = history[-1]["wall_s"]
  tokens = sum(r["trained_tokens"] for r in history)
  return {"benchmark": "replay", "part": "run", "run": kind, "pair": pair,
          "updates": len(history), "rl_s": round(rl_s, 3),
          # (the process's CPU seconds over the whole run, start-up included:
          # the work done; measured no less noisy than the wall time, since
          # the sampler's and learner's threads spin and wait alike)
          "cpu_s": round(cpu_s, 3),
          # (without the first update, whose 1-1.6 s of start-up swing more
          # than recording costs)
          "steady_s": round(rl_s - history[0]["wall_s"], 3),
          "updates_per_s": round(len(history) / rl_s, 2),
          "trained_tokens_per_s": round(tokens / rl_s, 1),
          "schedule_events": (len(schedule_lib.read_events(workdir)) if kind == "recorded"
                              else 0)}


class _Timers:
  """Wall seconds spent in `Log.write` and `LearnerLoop._follow_schedule`
  while installed (the recorded runs)."""

  def __init__(self):
    self.seconds = {"write": 0.0, "follow": 0.0}
    self.calls = {"write": 0, "follow": 0}
    self._originals = []

  def __enter__(self):
    self._originals = []
    for owner, name, key in ((schedule_lib.Log, "write", "write"),
                             (learner_loop.LearnerLoop, "_follow_schedule", "follow")):
      original = getattr(owner, name)
      self._originals.append((owner, name, original))
      setattr(owner, name, self._timed(original, key))
    return self

  def _timed(self, fn, key):
    def timed(*args, **kwargs):
      start = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self.seconds[key] += time.perf_counter() - start
        self.calls[key] += 1
    return timed

  def __exit__(self, *exc):
    for owner, name, original in self._originals:
      setattr(owner, name, original)


def cost_row(config, recorded: str, timers: _Timers, rl_s: float, updates: int) -> dict:
  """Recording's own work, in the recorded runs and alone (the module docstring)."""
  events = schedule_lib.read_events(recorded)
  with tempfile.TemporaryDirectory() as scratch:
    log = schedule_lib.Log(scratch)
    start = time.perf_counter()
    for event in events:
      log.write(event["e"], **{k: v for k, v in event.items() if k != "e"})
    log.close()
    event_s = (time.perf_counter() - start) / len(events)
  params = _params(config)
  fingerprint_s = report.median_seconds(lambda: fingerprint.fingerprint(params), 20)
  batch = [np.arange(64, dtype=np.int64).tobytes() + b"|" for _ in range(64)]
  hash_s = report.median_seconds(lambda: schedule_lib.digest(*batch), 20)
  in_run = timers.seconds["write"] + timers.seconds["follow"]
  return {"benchmark": "replay", "part": "cost", "recorded_updates": updates,
          "events_per_update": round(timers.calls["write"] / updates, 1),
          "in_run_write_ms": round(timers.seconds["write"] * 1e3, 1),
          "in_run_follow_ms": round(timers.seconds["follow"] * 1e3, 1),
          "in_run_fraction": round(in_run / rl_s, 4),
          "alone_event_us": round(event_s * 1e6, 1),
          "alone_fingerprint_ms": round(fingerprint_s * 1e3, 3),
          "alone_batch_hash_us": round(hash_s * 1e6, 1)}


def _params(config):
  """The run's model params, freshly initialised (what the fingerprint reads)."""
  from arl_jax.config import run_spec  # noqa: PLC0415
  from arl_jax.models import init_lib  # noqa: PLC0415
  from arl_jax.sharding import mesh_lib  # noqa: PLC0415
  from arl_jax.sharding import rules as rules_lib  # noqa: PLC0415

  spec = run_spec.resolve(config).spec
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  return init_lib.init_params(spec.model, meshes.learner, rules_lib.LEARNER_RULES, 0)[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60, help="updates a run")
  parser.add_argument("--pairs", type=int, default=3, help="plain/recorded pairs")
  parser.add_argument("--full", action="store_true", help="the arith config's model, not tiny")
  parser.add_argument("--quick", action="store_true", help="1 pair of 8 updates (a check)")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  if args.quick:
    args.pairs, args.steps = 1, 8
  rows = []
  with tempfile.TemporaryDirectory(prefix="replay_bench_") as scratch:
    # (a run of each kind first, not counted: they compile what each kind
    # runs; --quick, a check of the code path, times its compiles)
    for record in () if args.quick else (False, True):
      run_lib.run(_config(args.steps, args.full, record=record),
                  os.path.join(scratch, f"warm{int(record)}"), print_fn=lambda *_: None)
    recorded, timers = None, _Timers()
    for pair in range(args.pairs):
      kinds = ("plain", "recorded") if pair % 2 == 0 else ("recorded", "plain")
      for kind in kinds:
        workdir = os.path.join(scratch, f"{kind}{pair}")
        cpu = time.process_time()
        with timers if kind == "recorded" else contextlib.nullcontext():
          result = run_lib.run(_config(args.steps, args.full, record=kind == "recorded"),
                               workdir, print_fn=lambda *_: None)
        rows.append(_run_row(kind, pair, workdir, result, time.process_time() - cpu))
        if kind == "recorded":
          recorded = workdir
    workdir = os.path.join(scratch, "replayed")
    cpu = time.process_time()
    result = replay_lib.run(_config(args.steps, args.full, from_run=recorded), workdir,
                            print_fn=lambda *_: None)
    rows.append(_run_row("replayed", args.pairs - 1, workdir, result,
                         time.process_time() - cpu))
    runs = [r for r in rows if r["run"] == "recorded"]
    costs = cost_row(_config(args.steps, args.full), recorded, timers,
                     sum(r["rl_s"] for r in runs), sum(r["updates"] for r in runs))
  summary = {"benchmark": "replay", "part": "summary", "pairs": args.pairs}
  for key in ("rl_s", "steady_s", "cpu_s"):
    ratios = []
    for pair in range(args.pairs):
      by_kind = {r["run"]: r for r in rows if r["pair"] == pair and r["run"] != "replayed"}
      ratios.append(by_kind["recorded"][key] / by_kind["plain"][key])
    summary[f"recorded_over_plain_{key}"] = [round(x, 3) for x in ratios]
    summary[f"median_{key}"] = round(float(np.median(ratios)), 3)
    summary[f"mean_{key}"] = round(float(np.mean(ratios)), 3)
  summary["replayed_over_plain_rl_s"] = round(
      rows[-1]["rl_s"] / float(np.median([r["rl_s"] for r in rows if r["run"] == "plain"])), 3)
  for title, table in (("runs", rows), ("recording's own work", [costs]),
                       ("recorded / plain, paired", [summary])):
    report.print_table(table, title=title)
    report.append_jsonl(table, args.out)


if __name__ == "__main__":
  main()
