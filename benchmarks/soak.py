r"""Soak test: thousands of RL updates of the tiny arith config, watched over time.

One `arl_jax.training.run_lib.run` of `configs/arith.py:tiny` (its warm-up as
configured, evaluation every `--eval_every` updates), with three probes:

- resident memory (VmRSS of /proc/self/status), read by a background thread
  every `--rss_interval` seconds and at the end of every update (the
  `print_fn` of the run is called right after each update's record);
- step time: `step_seconds` of every RL record, minus the evaluation that ran
  before it (the run's step clock includes the evaluation after the previous
  update, so eval steps would otherwise look slow);
- compiles: `jax.monitoring` duration events. `compiles` counts
  `/jax/core/compile/backend_compile_duration`, which JAX records once per new
  executable (an in-memory jit cache miss), whether XLA compiled it or the
  persistent compilation cache supplied it; `cache_hits` counts those of them
  the persistent cache answered (`/jax/compilation_cache/cache_hits`, 0 unless
  JAX_COMPILATION_CACHE_DIR is set, as the test session does); `traces`
  counts `/jax/core/compile/jaxpr_trace_duration` (a jit retrace, which may
  or may not end in a compile). Each event keeps its function name.

Events and samples are placed on the run's step clock: the run's RL start is
recovered from the print times of step lines minus their `wall_s`, so each
one belongs to `setup` (warm-up, first evaluation, before the first update),
to update N (1-based) or to the evaluation after update N.

Rows: one per window (`--windows` equal spans of the updates: `updates`,
`step_s_mean`, `step_s_median`, `eval_s`, `rss_min_MB`, `rss_max_MB`,
`rss_end_MB`, `compiles`, `cache_hits`, `traces`) and a summary: RSS growth
from the end of the first window to the end of the run (MB and MB per 1000
updates, and a least-squares slope over every update after the first window),
compiles after update `--settle` (those of the first periodic evaluation left
out: it may compile once for the trained params), each listed with where it
happened and, from `jax_explain_cache_misses`, the input that changed, and
step-time drift = median of the last window / median of the second - 1.
Verdicts: `flat_memory` (growth <= `--rss_tolerance` of the RSS at the end of
the first window), `no_recompiles`, `drift_ok` (|drift| < `--drift_tolerance`).
(`run` keeps no step records in memory: `RunResult.history` is read back
from `metrics.jsonl` after the run, so none of the growth is there by design.)

  python benchmarks/soak.py --steps=14000 --out=/tmp/soak.jsonl   # ~14 min on 2 CPU cores
  python benchmarks/soak.py --quick                               # 30 updates
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import bisect  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from arl_jax.testing import tiny  # noqa: E402
from arl_jax.training import run_lib  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

# The event names as jax/_src/dispatch.py and compiler.py record them.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_STEP_LINE = re.compile(r"^step\s+(\d+) \|")
_MB = 1 << 20


def _rss_bytes() -> int:
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


class _MissLog(logging.Handler):
  """Keeps JAX's tracing-cache-miss explanations (`jax_explain_cache_misses`)
  with their time and thread, and passes every other record on as usual."""

  def __init__(self, into: list):
    super().__init__(level=logging.WARNING)
    self._into = into

  def emit(self, record: logging.LogRecord) -> None:
    message = record.getMessage()
    if message.startswith("TRACING CACHE MISS"):
      self._into.append((time.monotonic(), record.thread, message))
    else:  # (the "jax" logger does not propagate while the probe runs)
      logging.getLogger().handle(record)


class Probe:
  """Collects timestamped RSS samples, compile events and step-line times.

  Every list holds `(time.monotonic(), ...)` tuples; appends come from its
  own RSS thread, the JAX listeners (any thread that compiles) and the run's
  print_fn, and a list append is atomic under the GIL, so no lock.
  """

  def __init__(self, interval_s: float, progress_every: int, total: int):
    self.rss: list[tuple[float, int]] = []
    self.step_marks: list[tuple[float, int, int]] = []  # (t, step, rss)
    # (t, kind, fun_name, cache hit, thread id)
    self.events: list[tuple[float, str, str, bool, int]] = []
    self.misses: list[tuple[float, int, str]] = []  # (t, thread id, explanation)
    self._interval = interval_s
    self._progress_every = progress_every
    self._total = total
    self._stop = threading.Event()
    # The cache-hit event carries no function name; it fires inside the
    # backend-compile span on the same thread, so a thread-local flag ties
    # it to the compile event recorded when that span closes.
    self._hit = threading.local()
    self._thread = threading.Thread(target=self._sample, name="soak-rss", daemon=True)
    self._miss_log = _MissLog(self.misses)
    self._explain = None

  def _sample(self) -> None:
    while not self._stop.is_set():
      self.rss.append((time.monotonic(), _rss_bytes()))
      self._stop.wait(self._interval)

  def _on_event(self, event: str, **kwargs) -> None:
    del kwargs
    if event == CACHE_HIT_EVENT:
      self._hit.value = True

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    del duration
    if event == COMPILE_EVENT:
      hit = getattr(self._hit, "value", False)
      self._hit.value = False
      self.events.append((time.monotonic(), "compile", str(kwargs.get("fun_name", "?")), hit,
                          threading.get_ident()))
    elif event == TRACE_EVENT:
      self.events.append((time.monotonic(), "trace", str(kwargs.get("fun_name", "?")), False,
                          threading.get_ident()))

  def print_fn(self, line: str) -> None:
    """The run's print_fn: marks the end of every update (log_every=1)."""
    match = _STEP_LINE.match(line)
    if not match:
      return
    step = int(match.group(1))
    now, rss = time.monotonic(), _rss_bytes()
    self.step_marks.append((now, step, rss))
    self.rss.append((now, rss))
    if self._progress_every and (step + 1) % self._progress_every == 0:
      compiles = sum(1 for e in self.events if e[1] == "compile")
      print(f"  update {step + 1}/{self._total} | RSS {rss / _MB:.0f} MB | "
            f"{compiles} compiles so far", flush=True)

  def why(self, when: float, thread: int, fun_name: str) -> str:
    """The last line of the latest cache-miss explanation for `fun_name` on
    `thread` before `when` (the differing input, or "never seen function")."""
    name = re.sub(r"^jit\((.*)\)$", r"\1", fun_name)
    for t, th, message in reversed(self.misses):
      if t <= when and th == thread and f" {name} " in message.replace("(", " ("):
        lines = [line.strip(" *") for line in message.splitlines() if line.strip()]
        return lines[-1] if "never seen function" not in message else "first call"
    return ""

  def __enter__(self):
    # Why each trace missed the jit cache (logged only on a miss, so free in
    # the steady state); the explanations name the input that changed.
    self._explain = jax.config.jax_explain_cache_misses
    jax.config.update("jax_explain_cache_misses", True)
    jax_logger = logging.getLogger("jax")
    jax_logger.addHandler(self._miss_log)
    jax_logger.propagate = False
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    jax.monitoring.unregister_event_listener(self._on_event)
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    jax_logger = logging.getLogger("jax")
    jax_logger.removeHandler(self._miss_log)
    jax_logger.propagate = True
    jax.config.update("jax_explain_cache_misses", self._explain)


def _config(steps: int, eval_every: int, num_slots: int = 0):
  config = tiny.load_config("arith", "tiny")
  if num_slots:  # (--quick: fewer row buckets for the precompile below)
    config.sampler.num_slots = num_slots
  config.num_steps = steps
  config.eval_every = eval_every
  config.log_every = 1  # every update's line marks its end time for the probe
  # A long run: every program shape the sampler can use compiles at its start
  # (the tiny variant turns this off to keep short test runs short).
  config.sampler.precompile = True
  return config


def _timeline(result, probe: Probe):
  """Places the run on the probe's clock.

  Returns `(rl_start, update_end, eval_end)`: the RL clock's origin, the
  end of each update `[N]` and the end of the evaluation after update k
  (`{k: t}`, 1-based), all in `time.monotonic()`.
  """
  history = result.history
  marks = {step: t for t, step, _ in probe.step_marks}
  # A step line is printed right after its record's `wall_s` is taken (plus
  # the evaluation, for eval steps), so the smallest difference is the RL
  # start to within the print call.
  rl_start = min(marks[r["step"]] - r["wall_s"] for r in history)
  update_end = np.array([rl_start + r["wall_s"] for r in history])
  eval_end = {e["step"]: rl_start + e["rl_wall_s"] for e in result.eval_history
              if e["phase"] == "rl" and e["step"] > 0}
  return rl_start, update_end, eval_end


def _locate(t: float, rl_start: float, update_end: np.ndarray, eval_end: dict) -> tuple[str, int]:
  """`("setup", 0)`, `("update", N)` or `("eval", N)` (after update N) for time t."""
  if t <= rl_start:
    return "setup", 0
  k = int(np.searchsorted(update_end, t))  # updates finished before t
  if k >= len(update_end):
    return ("eval", k) if k in eval_end else ("end", k)
  if k in eval_end and t <= eval_end[k]:
    return "eval", k
  return "update", k + 1


def _pure_step_seconds(history, eval_end, rl_start) -> list[float]:
  """`step_seconds` of each update minus the evaluation that ran before it."""
  out = []
  for i, r in enumerate(history):
    seconds = r["step_seconds"]
    if i in eval_end:  # the evaluation after update i ran on update i+1's clock
      seconds -= eval_end[i] - (rl_start + history[i - 1]["wall_s"])
    out.append(seconds)
  return out


def _run(steps: int, eval_every: int, interval_s: float, progress_every: int,
         num_slots: int = 0):
  """`(RunResult, Probe, seconds)` of one probed run in a temporary workdir."""
  config = _config(steps, eval_every, num_slots)
  with tempfile.TemporaryDirectory() as workdir:
    with Probe(interval_s, progress_every, steps) as probe:
      start = time.monotonic()
      result = run_lib.run(config, workdir, print_fn=probe.print_fn)
      total_s = time.monotonic() - start
  return result, probe, total_s


def _window_row(lo: int, hi: int, t0: float, t1: float, step_s, eval_s: float, probe: Probe,
                end_rss: dict, events: list[dict]) -> dict:
  """Updates lo+1..hi, whose time runs from t0 to t1 (evaluations included)."""
  times = [t for t, _ in probe.rss]
  rss = [b for _, b in probe.rss[bisect.bisect_right(times, t0):bisect.bisect_right(times, t1)]]
  rss.append(end_rss[hi])  # (never empty, however short the window)
  inside = [e for e in events if e["phase"] in ("update", "eval") and lo < e["update"] <= hi]
  compiles = [e for e in inside if e["kind"] == "compile"]
  return {
      "benchmark": "soak", "part": "window", "updates": f"{lo + 1}-{hi}",
      "step_s_mean": round(statistics.fmean(step_s[lo:hi]), 4),
      "step_s_median": round(statistics.median(step_s[lo:hi]), 4),
      "eval_s": round(eval_s, 2),
      "rss_min_MB": round(min(rss) / _MB, 1), "rss_max_MB": round(max(rss) / _MB, 1),
      "rss_end_MB": round(end_rss[hi] / _MB, 1),
      "compiles": len(compiles), "cache_hits": sum(e["hit"] for e in compiles),
      "traces": sum(1 for e in inside if e["kind"] == "trace"),
  }


def measure(steps: int, windows: int, eval_every: int, settle: int, interval_s: float,
            rss_tolerance: float, drift_tolerance: float, quiet: bool,
            num_slots: int = 0) -> list[dict]:
  """One soak run: a row per window of updates and a summary row (module docstring)."""
  window = math.ceil(steps / windows)
  result, probe, total_s = _run(steps, eval_every, interval_s, 0 if quiet else window,
                                num_slots)
  history = result.history
  n = len(history)
  rl_start, update_end, eval_end = _timeline(result, probe)
  step_s = _pure_step_seconds(history, eval_end, rl_start)
  eval_s = {k: t - update_end[k - 1] for k, t in eval_end.items()}
  events = []
  for t, kind, name, hit, thread in probe.events:
    phase, update = _locate(t, rl_start, update_end, eval_end)
    events.append(dict(phase=phase, update=update, kind=kind, name=name, hit=hit,
                       why=probe.why(t, thread, name) if kind == "compile" else ""))
  end_rss = {step + 1: rss for _, step, rss in probe.step_marks}

  rows = []
  bounds = list(range(0, n, window)) + [n]
  for lo, hi in zip(bounds, bounds[1:]):
    # From the end of update lo's evaluation (if any) to the end of update hi's.
    t0 = rl_start if lo == 0 else max(update_end[lo - 1], eval_end.get(lo, 0.0))
    t1 = max(update_end[hi - 1], eval_end.get(hi, 0.0))
    rows.append(_window_row(lo, hi, t0, t1, step_s,
                            sum(v for k, v in eval_s.items() if lo < k <= hi), probe, end_rss,
                            events))

  first_end = bounds[1]
  growth = (end_rss[n] - end_rss[first_end]) / _MB
  later = range(first_end + 1, n + 1)
  # Two end points are at the mercy of the allocator's moods; a fit over every
  # update's RSS after the first window is the steadier rate.
  slope = (float(np.polyfit(list(later), [end_rss[u] / _MB for u in later], 1)[0]) * 1000
           if len(later) > 1 else 0.0)
  # The first periodic evaluation may compile once for the trained params'
  # layout; it is listed with the others but not counted against the run.
  first_eval = min(eval_end, default=None)
  late = [e for e in events if e["kind"] == "compile" and e["phase"] != "setup"
          and e["update"] > settle and (e["phase"], e["update"]) != ("eval", first_eval)]
  medians = [r["step_s_median"] for r in rows]
  drift = medians[-1] / medians[1] - 1 if len(medians) > 1 else 0.0
  summary = {
      "benchmark": "soak", "part": "summary", "updates": n, "window": window,
      "total_s": round(total_s, 1), "rl_s": round(history[-1]["wall_s"], 1),
      "compiles_setup": sum(1 for e in events if e["kind"] == "compile"
                            and e["phase"] == "setup"),
      "compiles_rl": sum(1 for e in events if e["kind"] == "compile" and e["phase"] != "setup"),
      "cache_hits": sum(e["hit"] for e in events if e["kind"] == "compile"),
      f"compiles_after_{settle}": len(late),
      "late_compile_sites": [
          f"{e['phase']} {e['update']}: {e['name']}" + (" (cache hit)" if e["hit"] else "")
          + (f" [{e['why']}]" if e["why"] else "") for e in late][:50],
      "rss_end_first_window_MB": round(end_rss[first_end] / _MB, 1),
      "rss_end_MB": round(end_rss[n] / _MB, 1),
      "rss_max_MB": round(max(b for _, b in probe.rss) / _MB, 1),
      "rss_growth_MB": round(growth, 1),
      "rss_growth_MB_per_1k": round(growth / max(n - first_end, 1) * 1000, 2),
      "rss_slope_MB_per_1k": round(slope, 2),
      "drift": round(drift, 3),
      "flat_memory": growth <= rss_tolerance * end_rss[first_end] / _MB,
      "no_recompiles": not late,
      "drift_ok": abs(drift) < drift_tolerance,
  }
  return rows + [summary]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=14000, help="RL updates")
  parser.add_argument("--windows", type=int, default=10, help="rows the updates are split into")
  parser.add_argument("--eval_every", type=int, default=250)
  parser.add_argument("--settle", type=int, default=20,
                      help="compiles after this many updates count as recompiles")
  parser.add_argument("--rss_interval", type=float, default=0.5, help="seconds between samples")
  parser.add_argument("--rss_tolerance", type=float, default=0.05,
                      help="flat_memory: growth after the first window <= this share of RSS")
  parser.add_argument("--drift_tolerance", type=float, default=0.10)
  parser.add_argument("--quick", action="store_true",
                      help="30 updates in 3 windows, evaluation every 10")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  steps, windows, eval_every = (30, 3, 10) if args.quick else (
      args.steps, args.windows, args.eval_every)
  rows = measure(steps, windows, eval_every, args.settle, args.rss_interval,
                 args.rss_tolerance, args.drift_tolerance, quiet=args.quick,
                 # --quick: 8 slots (two groups), not the tiny config's 32: precompiling
                 # every row bucket of 32 slots is most of a quick run.
                 num_slots=8 if args.quick else 0)
  summary = rows[-1]
  report.print_table(rows[:-1], title=f"soak: configs/arith.py:tiny, {steps} updates")
  report.print_table([{k: v for k, v in summary.items() if k != "late_compile_sites"}],
                     title="summary")
  for site in summary["late_compile_sites"]:
    print(f"late compile: {site}")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
