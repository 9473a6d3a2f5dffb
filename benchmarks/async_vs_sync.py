r"""Asynchronous vs synchronous RL on the agent and arith workloads, side by side in one run.

For each workload the same config runs twice, for the same number of updates:

- `sync`: max_async_level=0, K=0, drain (on-policy: the sampler produces the
  next batch only after the learner published the last update);
- `async`: max_async_level=1, K=8, in-flight weight updates, windowed FIFO
  assembly (30% of a batch).

Workloads: `tool_agent` (configs/tool_agent.py: multi-turn episodes whose tool
answers after a lognormal latency, median 50 ms, p99 0.5 s, capped at 2 s),
`openai_agent` (configs/openai_agent.py: the same task, model and seeds,
written as an OpenAI-client agent whose rollouts go through the run's
gateway: its rows against `tool_agent`'s compare the two paths) and
`arith` (configs/arith.py: single-turn, no environment latency). Both keep
their supervised warm-up, so rewards mean something; only RL updates are
timed (warm-up and compilation happen before the RL clock starts; the final
evaluation after it stops).

Columns: `rl_wall_s` (wall time of the RL updates), `trained_tok/s` (tokens
with loss mask 1 per second, over the updates after the first 10%: the
sampler compiles its insert shapes lazily during the first updates),
`learner_busy` (share of RL wall time the
learner was not waiting for a batch), `sampler_busy` (share the sampler thread
was decoding, prefilling or swapping), `lag`, `train_reward` (mean batch
reward over the last 20% of updates), `eval_reward` (greedy, held-out, after
the last update) and `speedup` (async trained tokens per second over sync's).
One seed: read reward differences against the eval's binomial noise
(+-0.04-0.06 at 64 prompts).

  python benchmarks/async_vs_sync.py --out=/tmp/async_vs_sync.jsonl   # ~6 min
  python benchmarks/async_vs_sync.py --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from arl_jax.testing import tiny
from arl_jax.training import run_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

MODES = {
    "sync": dict(max_async_level=0, max_off_policy_steps=0, weight_update="drain",
                 assembly="fifo"),
    "async": dict(max_async_level=1, max_off_policy_steps=8, weight_update="in_flight",
                  assembly="windowed_fifo"),
}
WORKLOADS = ("tool_agent", "openai_agent", "arith")


def _config(workload: str, mode: str, steps: int, quick: bool, pack_len: int = 0):
  config = tiny.load_config(workload, "tiny" if quick else None)
  config.learner.pack_len = pack_len
  settings = MODES[mode]
  config.num_steps = steps
  config.eval_every = 0 if quick else steps  # once, after the last update
  if quick:  # (a smoke test: a short warm-up; the policy rarely calls the tool)
    config.warmup.steps = 2
    # Tool answers 10x sooner: a sync batch waits for its slowest.
    if workload in ("tool_agent", "openai_agent"):
      config.env.update(latency_median_s=0.005, latency_p99_s=0.05, latency_max_s=0.2)
  config.log_every = 0
  config.orchestrator.update(max_async_level=settings["max_async_level"],
                             max_off_policy_steps=settings["max_off_policy_steps"],
                             assembly=settings["assembly"], window_fraction=0.3)
  config.sampler.weight_update = settings["weight_update"]
  return config


def run_mode(workload: str, mode: str, steps: int, quick: bool, pack_len: int = 0) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    start = time.monotonic()
    result = run_lib.run(_config(workload, mode, steps, quick, pack_len), workdir,
                         print_fn=lambda *_: None)
    total = time.monotonic() - start
  history = result.history
  last = history[-1]
  rl_wall = last["wall_s"]
  tail = history[-max(1, len(history) // 5):]
  skip = max(1, len(history) // 10)
  steady_tokens = sum(r["trained_tokens"] for r in history[skip:])
  steady_seconds = rl_wall - history[skip - 1]["wall_s"]
  return {
      "benchmark": "async_vs_sync", "workload": workload + ("_tiny" if quick else ""),
      "mode": mode, "pack_len": pack_len, "updates": len(history),
      "rl_wall_s": round(rl_wall, 2),
      "trained_tok/s": round(steady_tokens / steady_seconds, 1),
      "learner_busy": round(last["learner_busy_fraction"], 3),
      "sampler_busy": round(last["sampler_busy_fraction"], 3),
      "lag": round(float(np.mean([r["lag_mean"] for r in history])), 2),
      "train_reward": round(float(np.mean([r["reward_mean"] for r in tail])), 3),
      "eval_reward": round(result.eval_history[-1]["eval_reward"], 3)
      if result.eval_history else None,
      "total_wall_s": round(total, 1),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--workloads", default=",".join(WORKLOADS))
  parser.add_argument("--quick", action="store_true",
                      help="tool_agent's tiny config, 2 warm-up steps, 3 updates, no evaluation")
  parser.add_argument("--pack_len", type=int, default=0,
                      help="learner.pack_len of every run (0: one padded row per rollout)")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  steps = 3 if args.quick else args.steps
  workloads = ["tool_agent"] if args.quick else args.workloads.split(",")
  rows = []
  for workload in workloads:
    pair = [run_mode(workload, mode, steps, args.quick, args.pack_len) for mode in MODES]
    pair[1]["speedup"] = round(pair[1]["trained_tok/s"] / pair[0]["trained_tok/s"], 2)
    rows += pair
  report.print_table(rows, skip=("benchmark",))
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
