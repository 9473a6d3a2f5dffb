r"""Batch assembly policies, staleness bounds and requeueing, compared on one
simulated agent workload (no model: `arl_jax.testing.fake_sampler` drives the
real orchestrator with a fake sampler and a fake clock).

Workload: task difficulty d ~ U[0, 1); a group's completion time is
`base * exp(3 d) * lognormal(0, 0.5)` seconds (hard tasks are slow, with a
heavy tail), 64 sampler slots in groups, 16 groups per batch, learner update
`train_seconds`. Every configuration sees the same task stream and the same
duration draws, so the columns compare control decisions only:

- `s/update`: simulated seconds per learner update (throughput);
- `lag`, `in flight`, `in queue`: mean lag of trained groups and its split;
- `drop %`: rollouts dropped (stale + cancelled) / retired;
- `lost %`: tasks whose every retired group was dropped;
- `hard share`: share of trained groups with d > 0.7 (0.3 with no bias);
- `max disp`: how far out of dispatch order a group was trained.

  python benchmarks/orchestrator.py --out=/tmp/orchestrator.jsonl
  python benchmarks/orchestrator.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time

import numpy as np

from arl_jax.orchestrator import orchestrator_config
from arl_jax.testing import fake_sampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

GROUPS_PER_BATCH = 16
GROUP_SIZE = 4


@dataclasses.dataclass(frozen=True)
class Task:
  prompt_id: int
  difficulty: float


def _tasks(num_tasks: int, seed: int):
  difficulty = np.random.default_rng(seed).random(num_tasks)
  for i in itertools.count():
    yield Task(i % num_tasks, float(difficulty[i % num_tasks]))


def _durations(base: float, seed: int):
  rng = np.random.default_rng(seed + 1)
  return lambda task: base * float(np.exp(3.0 * task.difficulty) * rng.lognormal(0.0, 0.5))


def _simulate(name, *, assembly, k, max_async_level, requeue, steps, window_fraction=0.3,
              reference="dispatch", base=0.3, train_seconds=1.0, seed=0):
  cfg = fake_sampler.SimConfig(
      orchestrator=orchestrator_config.OrchestratorConfig(
          group_size=GROUP_SIZE, batch_size=GROUP_SIZE * GROUPS_PER_BATCH,
          max_async_level=max_async_level, max_off_policy_steps=k,
          staleness_reference=reference, requeue_dropped=requeue, assembly=assembly,
          window_fraction=window_fraction),
      num_steps=steps, train_seconds=train_seconds, num_slots=64 // GROUP_SIZE)
  start = time.perf_counter()
  result = fake_sampler.simulate(cfg, _tasks(2000, seed), _durations(base, seed))
  wall = time.perf_counter() - start
  metrics = result.orchestrator.ledger.metrics()
  lags = [c.batch.lag_metrics() for c in result.cuts]
  difficulty = [result.prompt_of[g.group_id].difficulty for c in result.cuts
                for g in c.batch.groups]
  displacement = 0
  for cut in result.cuts:
    queue = list(cut.pending)
    for g in cut.batch.groups:
      displacement = max(displacement, queue.index(g.group_id))
      queue.remove(g.group_id)
  return {
      "benchmark": "orchestrator", "config": name, "assembly": assembly, "K": k,
      "max_async_level": max_async_level, "requeue": requeue, "reference": reference,
      "updates": steps,
      "s/update": round(result.end_time / steps, 3),
      "lag": round(float(np.mean([m["lag_mean"] for m in lags])), 2),
      "in flight": round(float(np.mean([m["lag_in_flight_mean"] for m in lags])), 2),
      "in queue": round(float(np.mean([m["lag_in_queue_mean"] for m in lags])), 2),
      "drop %": round(100 * metrics["drop_rate"], 1),
      "lost %": round(100 * metrics["tasks_lost"] / max(metrics["tasks_seen"], 1), 1),
      "hard share": round(float(np.mean(np.array(difficulty) > 0.7)), 3),
      "max disp": displacement,
      "sim wall s": round(wall, 2),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--quick", action="store_true", help="30 updates per configuration")
  parser.add_argument("--out", default=None, help="append JSON rows here")
  args = parser.parse_args()
  steps = 30 if args.quick else args.steps
  grid = [("sync", dict(assembly="fifo", k=0, max_async_level=0, requeue=0))]
  for assembly in ("fifo", "windowed_fifo", "first_done"):
    for k in (2, 8):
      grid.append((f"{assembly} K={k}", dict(assembly=assembly, k=k, max_async_level=2,
                                              requeue=0)))
  grid.append(("first_done K=2 requeue=2", dict(assembly="first_done", k=2, max_async_level=2,
                                                 requeue=2)))
  grid.append(("first_done K=2 oldest_token", dict(assembly="first_done", k=2,
                                                    max_async_level=2, requeue=0,
                                                    reference="oldest_token")))
  rows = [_simulate(name, steps=steps, **kw) for name, kw in grid]
  report.print_table(rows, title=f"orchestrator policies, simulated ({steps} updates each)",
                     skip=("benchmark", "assembly", "K", "max_async_level", "requeue",
                           "reference", "updates"))
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
