r"""Asynchronous vs synchronous RL on the arith workload, side by side in one run.

Runs the same config twice (no warm-up, no evaluation, so only RL steps are
timed): synchronous (max_async_level=0, K=0, drain) and asynchronous
(max_async_level=1, K=8, in-flight updates), then prints a table and writes
one JSON row per mode.

  python benchmarks/async_vs_sync.py --steps=100 --out=/tmp/async_vs_sync.jsonl
  python benchmarks/async_vs_sync.py --quick

On a 2-core CPU both modes compete for the same cores, so the asynchronous
gain here comes mostly from overlapping host work (batch assembly, scoring,
Python control) with device work; JAX_NOTES.md measured only 1.1-1.2x overlap
for two compute-bound threads on this machine. The agent workload with
tool latency (the environments issue) is where the asynchronous design is
meant to win big.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from arl_jax import run_lib
from arl_jax.testing import tiny

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

MODES = {
    "sync": dict(max_async_level=0, max_off_policy_steps=0, weight_update="drain"),
    "async": dict(max_async_level=1, max_off_policy_steps=8, weight_update="in_flight"),
}


def _config(mode: str, steps: int, quick: bool):
  config = tiny.load_config("arith", "tiny" if quick else None)
  settings = MODES[mode]
  config.num_steps = steps
  config.eval_every = 0
  config.log_every = 0
  config.warmup.steps = 0
  config.orchestrator.max_async_level = settings["max_async_level"]
  config.orchestrator.max_off_policy_steps = settings["max_off_policy_steps"]
  config.sampler.weight_update = settings["weight_update"]
  return config


def run_mode(mode: str, steps: int, quick: bool) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    start = time.monotonic()
    result = run_lib.run(_config(mode, steps, quick), workdir, print_fn=lambda *_: None)
    wall = time.monotonic() - start
  history = result.history
  # Skip the first steps: they include compilation.
  steady = history[min(5, len(history) - 1):]
  step_s = float(np.median([r["step_seconds"] for r in steady]))
  tokens = sum(r["trained_tokens"] for r in steady)
  seconds = sum(r["step_seconds"] for r in steady)
  return {
      "benchmark": "async_vs_sync", "workload": "arith" + ("_tiny" if quick else ""),
      "mode": mode, "updates": len(history), "wall_s": round(wall, 3),
      "median_step_s": round(step_s, 4), "trained_tokens_per_s": round(tokens / seconds, 1),
      "mean_lag": round(float(np.mean([r["lag_mean"] for r in history])), 3),
      "sampler_busy_s": round(history[-1]["sampler_busy_s"], 3),
      "final_batch_reward": round(float(np.mean([r["reward_mean"] for r in history[-10:]])), 4),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  steps = 12 if args.quick else args.steps
  rows = [run_mode(mode, steps, args.quick) for mode in MODES]
  # Steady-state trained tokens per second (compilation steps excluded).
  rows[1]["speedup_vs_sync"] = round(
      rows[1]["trained_tokens_per_s"] / rows[0]["trained_tokens_per_s"], 3)
  report.print_table(rows, skip=("benchmark",))
  print(f"async / sync steady-state trained tokens per second: {rows[1]['speedup_vs_sync']}x")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
