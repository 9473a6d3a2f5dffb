r"""Sampler fleet benchmark: the same run with its sampler in the learner
process (`local`) or in 1 or 2 sampler processes that join over ZeroMQ and
pull weights with `jax.experimental.transfer` (`remote`), side by side in one
invocation.

  python benchmarks/fleet.py --out=/tmp/fleet.jsonl   # configs/arith.py, ~3 min on 2 cores
  python benchmarks/fleet.py --quick                  # tiny model, local vs 1 remote

Every mode is a fresh `python -m arl_jax.launch` on `configs/arith.py` (tiny
with --quick) with its defaults (K=8, max_async_level=1), no warm-up and no
evaluation; sampler processes run `python -m arl_jax.distributed.sampler_worker`.
Devices: the learner process has 2 CPU devices (learner mesh 1; sampler mesh 1,
the local engine's, or where remote samplers' versions are staged), each
sampler process 1.

Columns, from the learner's `metrics.jsonl`, over the updates after the first
`--skip` (compilation): `updates_per_s`; `trained_tokens_per_s` (mean of the
step records' `tokens_per_s`); `lag_mean`; and from the last record
(cumulative): `learner_busy` (share of RL time not waiting for a batch),
`sampler_tokens_per_s` (sampled tokens per second of sampler busy time,
summed over samplers), `weight_pulls` (versions served to remote samplers).

This machine has 2 cores shared by every process: the remote modes measure
what the fleet costs (messages, pulls, a second JAX runtime competing for the
same cores), not how sampling scales with hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(devices: int) -> dict:
  # The caller's other XLA flags kept (the tests' cheap compiles); the last
  # device-count flag wins.
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())


def run_mode(samplers: int, *, steps: int, skip: int, quick: bool, timeout_s: float) -> dict:
  """One run with `samplers` sampler processes (0: the local engine)."""
  workdir = tempfile.mkdtemp(prefix="arl_fleet_bench_")
  config = "configs/arith.py:tiny" if quick else "configs/arith.py"
  learner = subprocess.Popen(
      [sys.executable, "-m", "arl_jax.launch", f"--config={config}", f"--workdir={workdir}",
       f"--config.num_steps={steps}", "--config.eval_every=0", "--config.warmup.steps=0",
       "--config.log_every=0", "--config.mesh.placement=disaggregated",
       "--config.mesh.learner_devices=1", f"--config.fleet.remote={samplers > 0}"],
      cwd=REPO, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  procs = []
  try:
    if samplers:
      address = _fleet_address(workdir, learner, timeout_s)
      procs = [subprocess.Popen(
          [sys.executable, "-m", "arl_jax.distributed.sampler_worker", f"--learner={address}",
           f"--name=bench{i}"], cwd=REPO, env=_env(1), stdout=subprocess.DEVNULL,
          stderr=subprocess.DEVNULL) for i in range(samplers)]
    out, _ = learner.communicate(timeout=timeout_s)
    if learner.returncode:
      raise RuntimeError(f"the learner failed:\n{out[-3000:]}")
    for proc in procs:
      proc.wait(timeout=60)
  finally:
    for proc in [learner, *procs]:
      if proc.poll() is None:
        proc.kill()
  try:
    return _summarise(workdir, samplers, skip, quick)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _fleet_address(workdir: str, learner: subprocess.Popen, timeout_s: float) -> str:
  path = os.path.join(workdir, "fleet.json")
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path):
    if learner.poll() is not None:
      raise RuntimeError(f"the learner exited:\n{learner.communicate()[0][-3000:]}")
    if time.monotonic() > deadline:
      raise TimeoutError("the learner never wrote fleet.json")
    time.sleep(0.1)
  time.sleep(0.1)  # written in one call; let it land
  with open(path, encoding="utf-8") as f:
    return json.load(f)["address"]


def _summarise(workdir: str, samplers: int, skip: int, quick: bool) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [r for r in map(json.loads, f) if r.get("phase") == "rl" and "step" in r]
  measured = records[skip:]
  if len(measured) < 2:
    raise RuntimeError(f"only {len(records)} updates; use more --steps than --skip + 1")
  span = measured[-1]["wall_s"] - measured[0]["wall_s"]
  last = records[-1]
  return {
      "benchmark": "fleet", "workload": "arith" + ("_tiny" if quick else ""),
      "mode": "remote" if samplers else "local", "sampler_processes": samplers,
      "updates": len(records), "measured_updates": len(measured) - 1,
      "updates_per_s": round((len(measured) - 1) / span, 2),
      "trained_tokens_per_s": round(
          sum(r["tokens_per_s"] for r in measured[1:]) / (len(measured) - 1), 1),
      "lag_mean": round(sum(r["lag_mean"] for r in measured) / len(measured), 2),
      "learner_busy": round(last["learner_busy_fraction"], 3),
      "sampler_tokens_per_s": round(last["sampler_tokens_per_s"], 1),
      "weight_pulls": last.get("fleet_weight_pulls", 0),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny model, few updates, local vs 1 sampler process")
  parser.add_argument("--steps", type=int, default=None, help="updates per run (default 40)")
  parser.add_argument("--skip", type=int, default=2, help="first updates left out (compiles)")
  parser.add_argument("--out", default=None, help="append JSON rows here")
  args = parser.parse_args()
  steps = args.steps or (4 if args.quick else 40)
  counts = (0, 1) if args.quick else (0, 1, 2)
  rows = [run_mode(n, steps=steps, skip=args.skip, quick=args.quick, timeout_s=600)
          for n in counts]
  report.print_table(rows, title=f"sampler fleet: {rows[0]['workload']}, {steps} updates")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
