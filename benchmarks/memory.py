r"""Who holds a run's memory: its `memory.jsonl` as tables, beside `--dry_run`'s plan.

  python benchmarks/memory.py --config=configs/smollm2.py:/tmp/smollm2   # ~10 min on 2 cores
  python benchmarks/memory.py --config=arith --steps=20 --every=10
  python benchmarks/memory.py --config=smollm2:/tmp/smollm2 --config.learner.lora.rank=16
  python benchmarks/memory.py --quick      # the tiny arith config, 4 updates, ~40 s

Runs `python -m arl_jax.launch` on the config (every `--config.*` override
with it) in a child process on one CPU device, as on a user's machine
(`--devices=N` for more), for `--steps` updates with an evaluation and a
checkpoint every `--every`, then reads the run's `memory.jsonl`
(`metrics/memory_log.py`). Parts:

- `run`: the run's wall time and its median update's seconds (the first,
  which compiles, left out).
- `phases`: a row per phase end (the start-up's phases, each update,
  evaluation and checkpoint, the stop): `peak` is the resident host peak
  over the phase, `rss` the resident size at its end, `live` every live
  device array, then each owner's arrays (`metrics/memory_ledger.py`:
  learner params, optimizer state, sampler params, KV caches, evaluation,
  `unclaimed`). MiB, all devices of the process together.
- `plan`: each component the run's own `--dry_run` plan holds per device,
  the owner that holds it and the most that owner held at a phase's end;
  the process (on a CPU backend: `training/process_plan.py`) against the
  most the resident size exceeded the live arrays by at a phase's end; then
  the plan's busiest device against the run's largest `live` and its
  resident peak (`peak / plan`: the issue-56 target is <= 1.25).
- `program` (unless `--programs=false`): the compiled update's own memory at
  the config's batch shape (XLA's `memory_analysis`: arguments, outputs,
  temporaries, code), which a phase's peak holds while it runs and the
  ledger, between phases, does not see. The `run` row names the sampler's
  precompiled program with the most temporaries and how many (the run's
  own `memory_analysis` of each, `sampler_largest_program` in its
  metrics), which runs beside the update on a colocated device.
"""

from __future__ import annotations

import os

# One CPU device, as the run on a user's machine has; before JAX initialises.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=1").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_CONFIG = "--config=arith:tiny"

# Which ledger owner holds each component `--dry_run` plans.
PLANNED_OWNER = {"params": "learner params", "frozen_base": "frozen base",
                 "adapters": "learner params", "adam_moments": "optimizer state",
                 "kl_reference_params": "kl reference", "base": "sampler params",
                 "base_from_learner": "frozen base",
                 "kv_cache": "sampler kv cache", "slot_state": "sampler kv cache",
                 "eval_kv_cache": "evaluation kv cache",
                 "eval_sampled_kv_cache": "evaluation kv cache"}


def _mib(num_bytes) -> float | None:
  return None if num_bytes is None else round(num_bytes / 2**20, 1)


def _owner_of(component: str) -> str | None:
  if component.startswith(("params_x", "adapters_x")):
    return "sampler params"
  if component.startswith("kv_cache_paged"):
    return "sampler kv cache"
  return PLANNED_OWNER.get(component)


def launch(config_args: list[str], workdir: str, *, steps: int, every: int,
           devices: int) -> tuple[dict, list[dict]]:
  """The run's times (wall seconds, the median update's after the first)
  and its `memory.jsonl` rows."""
  command = [sys.executable, "-m", "arl_jax.launch", *config_args, f"--workdir={workdir}",
             f"--config.num_steps={steps}", f"--config.eval_every={every}",
             f"--config.checkpoint.every_steps={every}", "--config.log_every=1"]
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  print("$ " + " ".join(command), flush=True)
  start = time.perf_counter()
  proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if proc.returncode:
    raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                     f"{proc.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    steps = [r for r in map(json.loads, f) if r.get("phase") == "rl" and "step_seconds" in r]
  updates = [r["step_seconds"] for r in steps]
  times = {"benchmark": "memory", "part": "run", "wall s": round(wall, 1),
           "updates": len(updates),
           "median update s": round(statistics.median(updates[1:]), 2) if len(updates) > 1
           else None}
  # (the sampler's precompiled program with the most temporaries, as the run saw it)
  largest = next((r for r in steps if "sampler_largest_program" in r), None)
  if largest is not None:
    times["sampler's largest program"] = largest["sampler_largest_program"]
    times["its temporaries MiB"] = _mib(largest["sampler_largest_program_temporaries_bytes"])
  with open(os.path.join(workdir, "memory.jsonl"), encoding="utf-8") as f:
    return times, [json.loads(line) for line in f]


def phase_rows(rows: list[dict]) -> list[dict]:
  out = []
  for r in rows:
    if r["phase"] == "plan":
      continue
    row = {"benchmark": "memory", "part": "phases", "phase": r["phase"], "step": r["step"],
           "peak": _mib(r["peak_bytes"]), "rss": _mib(r["host_rss_bytes"]),
           "live": _mib(r["live_bytes"]),
           "release ms": None if r.get("release_s") is None else round(1e3 * r["release_s"], 1)}
    row.update({owner: _mib(b) for owner, b in r["by_owner"].items()})
    out.append(row)
  return out


def plan_rows(rows: list[dict]) -> list[dict]:
  """The plan's components beside what their owners held, then the totals."""
  plan = next(r for r in rows if r["phase"] == "plan")
  if "error" in plan:
    return [{"benchmark": "memory", "part": "plan", "what": f"no plan: {plan['error']}"}]
  measured = [r for r in rows if r["phase"] != "plan"]
  most = {}
  for r in measured:
    for owner, b in r["by_owner"].items():
      most[owner] = max(most.get(owner, 0), b)
  out = []
  for role in ("learner", "sampler"):
    for component, planned in plan[role].items():
      owner = _owner_of(component)
      out.append({"benchmark": "memory", "part": "plan", "what": f"{role}: {component}",
                  "planned MiB": _mib(planned), "owner": owner or "(inside a program)",
                  "owner's most MiB": _mib(most.get(owner)) if owner else None})
  if plan.get("process"):  # (a CPU backend: resident size beyond the arrays at phase ends)
    beyond = [r["host_rss_bytes"] - r["live_bytes"] for r in measured
              if r.get("host_rss_bytes") is not None]
    out.append({"benchmark": "memory", "part": "plan", "what": "process (rough)",
                "planned MiB": _mib(plan["process"]), "owner": "(rss beyond the arrays)",
                "owner's most MiB": _mib(max(beyond)) if beyond else None})
  planned = plan["busiest_device_bytes"]
  live = max(r["busiest_device_bytes"] for r in measured)
  peaks = [r["peak_bytes"] for r in measured if r["peak_bytes"] is not None]
  totals = [("plan: busiest device", planned), ("measured: most live arrays", live),
            ("measured: resident peak", max(peaks) if peaks else None)]
  for what, b in totals:
    out.append({"benchmark": "memory", "part": "plan", "what": what, "planned MiB": None,
                "owner": None, "owner's most MiB": _mib(b),
                "x plan": None if b is None else round(b / planned, 2)})
  return out


def program_row(config) -> dict:
  """The compiled update's memory at the config's batch shape."""
  import learner as learner_bench  # noqa: PLC0415  (benchmarks/learner.py)

  from arl_jax.config import run_spec  # noqa: PLC0415

  resolved = run_spec.resolve(config)
  update_fn, state, batch, _ = learner_bench.run_update(resolved)
  start = time.perf_counter()
  memory = update_fn.lower(state, batch).compile().memory_analysis()
  return {"benchmark": "memory", "part": "program", "program": "update",
          "rows x width": "x".join(map(str, batch.tokens.shape)),
          "arguments MiB": _mib(memory.argument_size_in_bytes),
          "outputs MiB": _mib(memory.output_size_in_bytes),
          "aliased MiB": _mib(memory.alias_size_in_bytes),
          "temporaries MiB": _mib(memory.temp_size_in_bytes),
          "code MiB": round(memory.generated_code_size_in_bytes / 2**20, 1),
          "compile s": round(time.perf_counter() - start, 1)}


def _config(config_args: list[str]):
  """The config the child runs, resolved here the way the launcher does."""
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  from arl_jax.config import cli_argument  # noqa: PLC0415

  holder = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config", flag_values=holder)
  holder(["memory.py", *cli_argument.resolve(config_args)])
  return holder.config


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help=f"{QUICK_CONFIG}, 4 updates")
  parser.add_argument("--steps", type=int, default=10, help="updates to run")
  parser.add_argument("--every", type=int, default=5, help="evaluate and save every N updates")
  parser.add_argument("--devices", type=int, default=1, help="CPU devices of the run")
  parser.add_argument("--programs", default="true", choices=("true", "false"),
                      help="compile the update here for its own memory")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args, config_args = parser.parse_known_args()
  if args.quick:
    config_args, args.steps, args.every = [QUICK_CONFIG], 4, 2
  bad = [a for a in config_args if not a.startswith("--config")]
  if bad or not config_args:
    parser.error(f"expected --config=... and --config.KEY=VALUE overrides, got {bad or 'none'}")
  tables = []
  with tempfile.TemporaryDirectory(prefix="memory_") as scratch:
    times, rows = launch(config_args, os.path.join(scratch, "run"), steps=args.steps,
                         every=args.every, devices=args.devices)
  tables += [("run: wall time and the median update (after the first)", [times]),
             ("phases: MiB at each phase's end (peak: over the phase)", phase_rows(rows)),
             ("plan: --dry_run's components beside their owners", plan_rows(rows))]
  if args.programs == "true":
    tables.append(("program: the compiled update", [program_row(_config(config_args))]))
  for title, table in tables:
    report.print_table(table, title=title)
    report.append_jsonl(table, args.out)


if __name__ == "__main__":
  main()
