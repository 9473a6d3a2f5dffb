r"""Two sampler defaults from a config's shapes, measured through the whole
engine: `sampler.kv_cache` (dense or paged) by slot length, and
`sampler.decode_burst` (1 or 4) by model size.

  python benchmarks/engine_defaults.py --out=/tmp/engine_defaults.jsonl   # ~9.5 min, 2 cores
  python benchmarks/engine_defaults.py --quick                            # ~45 s, tiny model
  python benchmarks/engine_defaults.py --parts=burst                      # one part (~70 s)
  python benchmarks/engine_defaults.py --parts=cache                      # cold vs warm starts
  python benchmarks/engine_defaults.py --parts=long_slots                 # 1k vs 8k-column slots

Every row runs a fresh engine (`sampler.precompile` on, one CPU device) on
2 x num_slots one-rollout requests with 16-token prompts, every completion
running to its budget (`max_new_tokens`; EOS is never sampled), as
`engine_harness.run_engine` does. Parts (every number measured in this run,
one timed run per row):

- `kv_cache`: "tiny" and "3M" (`sampler.py`'s models), 32 slots,
  max_new_tokens 64, 256 and 1,024; dense against paged (pages of 16, the
  default pool: enough pages for every slot at full length, no preemption),
  decode attention read in blocks (`attention` "blocks", the default) and
  gathered whole, a program per width ("widths", `attention_block=0`:
  `engine_harness.ATTENTION`), decode_burst 1.
- `burst`: "tiny" and "3M", 32 slots, dense, max_new_tokens 128;
  decode_burst 1 against 4.
- `cache`: start-up from an empty and from a warm persistent compilation
  cache (`config.compilation_cache`, `compile_cache.py`): each start a
  fresh process (in-memory jit caches empty) running the engine until its
  first admission, dense and paged (blocks and widths), "3M", 32 slots, 1,024 new tokens
  (`--cache_budgets`); `programs` / `from_cache` count the executables
  built (`compile_cache.ProgramCounter`), `precompile_s` the engine's own
  ahead-of-time compile.
- `long_slots` (not run by default, ~10 min): slots sized for 1,024 and for
  8,192 new tokens, dense against paged (blocks), each serving the same
  requests shorter than the slot (`request_tokens`; what an RL run's
  completions are when `max_new_tokens` caps the few longest): "tiny", 32
  slots, 1,024-token requests; "3M", 8 slots, 512-token requests. The
  start-up beside the steady tokens/s, whatever the slot's length.
- `round_trip` (from the `burst` rows): a decode call's seconds split into a
  fixed host cost per call and device work per step, from the engine's own
  decode time per call at burst 1 and per step at burst 4 (a negative
  host cost: burst 4's steps cost more than burst 1's, no host cost shows).

Columns: `slot_len` the columns of a slot (`EngineConfig.length`: prompt,
budget, spare continuation columns, whole pages when paged); `programs` what
precompile compiles (`precompile.engine_shapes(cfg).num_programs`);
`precompile_s` its seconds (engine stats); `startup_s` from the call to
`engine.start()` (which precompiles on the calling thread before it returns)
until the engine's first admission returned: its prefill sampled the first
tokens and the host read their done flags (`stats.inserts > 0`, polled every
millisecond); `busy_tok_s` sampled tokens over engine busy seconds (decode,
prefill, swaps: no compiles); `e2e_tok_s` sampled tokens over wall seconds
from `engine.start()` to the last finished segment (startup included);
`decode_ms_step` and `decode_ms_call` the engine's decode seconds per
decode step and per device call (`device_calls`: model passes); `vs_*` the
row over its dense (or burst 1) twin. The table leaves out what the JSON
rows also hold: tokens, decode and prefill seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import engine_config, precompile, sampling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_harness  # noqa: E402  (benchmarks/engine_harness.py)
import report  # noqa: E402  (benchmarks/report.py, run as a script)
import sampler as sampler_bench  # noqa: E402  (benchmarks/sampler.py: models)

PROMPT = 16


def _engine_cfg(slots, max_new_tokens, attention="dense", burst=1):
  """`attention`: one of `engine_harness.ATTENTION` (dense, or paged reading
  blocks or widths)."""
  return engine_config.EngineConfig(prompt_len=PROMPT, num_slots=slots, group_size=1,
                                    max_new_tokens=max_new_tokens, precompile=True,
                                    **engine_harness.ATTENTION[attention], page_size=16,
                                    kv_pages=0, decode_burst=burst)


def _attention(ecfg) -> str:
  """The name in `engine_harness.ATTENTION` of how `ecfg` attends."""
  return "dense" if not ecfg.paged else "blocks" if ecfg.decode_block else "widths"


def run(model, ecfg, requests, request_tokens=None):
  """Runs an engine configured by `ecfg` on `requests` one-rollout requests of
  budget `request_tokens` (default: `max_new_tokens`) until every one is done
  (the loop of `engine_harness.run_engine`, plus the startup clock); its
  stats, wall seconds and startup seconds, both from the call to
  `engine.start()`."""
  cfg, meshes, graphdef, params = model
  budgets = np.full((requests,), request_tokens or ecfg.max_new_tokens, np.int32)
  done = []
  # A token id outside the model's vocabulary: never sampled.
  settings = sampling.SamplingSettings(eos_id=10 ** 6, pad_id=sampler_bench.PAD)
  engine = engine_lib.SamplerEngine(
      cfg=ecfg, settings=settings, graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
      publisher=engine_harness.Params(params), dispatcher=engine_harness.Requests(budgets, PROMPT),
      on_segment_fn=done.append)
  start = time.perf_counter()
  engine.start()  # (precompiles every program before it returns)
  while not engine.stats.inserts:  # the first admission: first tokens sampled
    engine.raise_if_failed()
    time.sleep(0.001)
  startup = time.perf_counter() - start
  while len(done) < len(budgets):
    engine.raise_if_failed()
    time.sleep(0.02)
  seconds = time.perf_counter() - start
  engine.stop()
  return engine.stats, seconds, startup


def measure(name, model, ecfg, requests, request_tokens=None):
  """One row: the engine's shapes, startup and tokens/s on `requests` requests
  of `request_tokens` new tokens (default: the slot's `max_new_tokens`)."""
  request_tokens = request_tokens or ecfg.max_new_tokens
  stats, seconds, startup = run(model, ecfg, requests, request_tokens)
  assert stats.sampled_tokens == requests * request_tokens, stats.sampled_tokens
  assert stats.precompiled_programs == precompile.engine_shapes(ecfg).num_programs
  return {"model": name, "slots": ecfg.num_slots, "max_new_tokens": ecfg.max_new_tokens,
          "request_tokens": request_tokens, "slot_len": ecfg.length, "kv_cache": ecfg.kv_cache,
          "attention": _attention(ecfg), "decode_burst": ecfg.decode_burst,
          "programs": precompile.engine_shapes(ecfg).num_programs,
          "precompile_s": round(stats.precompile_seconds, 2), "startup_s": round(startup, 2),
          "tokens": stats.sampled_tokens, "busy_s": round(stats.busy_seconds, 2),
          "wall_s": round(seconds, 2),
          "busy_tok_s": round(stats.sampled_tokens / stats.busy_seconds, 1),
          "e2e_tok_s": round(stats.sampled_tokens / seconds, 1),
          "device_calls": stats.model_passes, "steps": stats.steps,
          "decode_s": round(stats.decode_seconds, 2),
          "prefill_s": round(stats.prefill_seconds, 2),
          "decode_ms_step": round(1e3 * stats.decode_seconds / max(stats.steps, 1), 3),
          "decode_ms_call": round(1e3 * stats.decode_seconds / max(stats.model_passes, 1), 3),
          "occupancy": round(stats.occupancy, 3)}


def start_only(name, ecfg, cache_dir) -> dict:
  """In this (fresh) process: JAX's persistent cache in `cache_dir`, an engine
  started until its first admission; the start-up row."""
  from arl_jax.core import compile_cache  # noqa: PLC0415

  compile_cache.enable(cache_dir)
  with compile_cache.ProgramCounter() as programs:
    cfg, meshes, graphdef, params = sampler_bench._model(name, ecfg.length)  # noqa: SLF001
    settings = sampling.SamplingSettings(eos_id=10 ** 6, pad_id=sampler_bench.PAD)
    budgets = np.full((ecfg.num_slots,), ecfg.max_new_tokens, np.int32)
    engine = engine_lib.SamplerEngine(
        cfg=ecfg, settings=settings, graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
        publisher=engine_harness.Params(params),
        dispatcher=engine_harness.Requests(budgets, PROMPT), on_segment_fn=lambda _: None)
    start = time.perf_counter()
    engine.start()
    while not engine.stats.inserts:
      engine.raise_if_failed()
      time.sleep(0.001)
    startup = time.perf_counter() - start
    engine.stop()
  return {"model": name, "slots": ecfg.num_slots, "max_new_tokens": ecfg.max_new_tokens,
          "slot_len": ecfg.length, "kv_cache": ecfg.kv_cache, "attention": _attention(ecfg),
          "startup_s": round(startup, 2),
          "precompile_s": round(engine.stats.precompile_seconds, 2),
          "programs": programs.programs, "from_cache": programs.from_cache}


def start_in_child(name, attention, slots, max_new_tokens, cache_dir) -> dict:
  """`start_only` in a new Python process (so nothing is compiled yet)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  args = json.dumps([name, attention, slots, max_new_tokens, cache_dir])
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--child={args}"],
                        env=env, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"the start-up child failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def long_slots(quick, emit) -> None:
  """The `long_slots` part: start-up and steady tokens/s with slots sized for
  1,024 and 8,192 new tokens, serving the same shorter requests."""
  # (model, slots, request tokens)
  cases = [("tiny", 4, 64)] if quick else [("tiny", 32, 1024), ("3M", 8, 512)]
  slot_budgets = (128, 1024) if quick else (1024, 8192)
  for name, slots, request_tokens in cases:
    model = sampler_bench._model(name, _engine_cfg(slots, max(slot_budgets), "blocks").length)  # noqa: SLF001
    for n in slot_budgets:
      dense = measure(name, model, _engine_cfg(slots, n, "dense"), 2 * slots, request_tokens)
      emit({"benchmark": "engine_defaults", "part": "long_slots", **dense,
            **vs(dense, dense, "vs_dense")})
      paged = measure(name, model, _engine_cfg(slots, n, "blocks"), 2 * slots, request_tokens)
      emit({"benchmark": "engine_defaults", "part": "long_slots", **paged,
            **vs(paged, dense, "vs_dense"),
            "startup_vs_dense": round(paged["startup_s"] / dense["startup_s"], 2)})


def vs(row, base, label):
  """`row`'s busy and end-to-end tokens/s over `base`'s."""
  return {f"busy_{label}": round(row["busy_tok_s"] / base["busy_tok_s"], 2),
          f"e2e_{label}": round(row["e2e_tok_s"] / base["e2e_tok_s"], 2)}


def round_trip(one, four):
  """Host cost per decode call and work per step, from the decode seconds per
  call at burst 1 (t1 = host + step) and per step at burst 4 (t4 = host *
  calls / steps + step; calls / steps ~1/4, a call takes one step while rows
  wait): host = (t1 - t4) / (1 - calls / steps). A burst of 4 speeds the
  decode up by t1 / t4 (~(host + step) / (host / 4 + step): >= 10% while
  step <= 7.25 x host)."""
  t1, t4 = one["decode_ms_call"], four["decode_ms_step"]
  host = (t1 - t4) / (1 - four["device_calls"] / four["steps"])
  return {"model": one["model"], "slots": one["slots"], "max_new_tokens": one["max_new_tokens"],
          "burst1_ms_per_call": t1, "burst4_ms_per_step": t4,
          "burst4_ms_per_call": four["decode_ms_call"], "host_ms_per_call": round(host, 3),
          "step_ms": round(t1 - host, 3), "decode_speedup": round(t1 / t4, 2),
          "gain_10pct_below_step_ms": round(7.25 * host, 2)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny model, 4 slots, short budgets")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  parser.add_argument("--parts", default="kv_cache,burst,cache", help="comma-separated parts")
  parser.add_argument("--cache_budgets", default="1024",
                      help="cache: comma-separated max_new_tokens (slot columns ~ 16 + this)")
  parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # (start_in_child)
  args = parser.parse_args()
  if args.child:
    name, attention, slots, max_new_tokens, cache_dir = json.loads(args.child)
    print(json.dumps(start_only(name, _engine_cfg(slots, max_new_tokens, attention), cache_dir)))
    return
  parts = set(args.parts.split(","))
  rows = []
  emit = lambda row: (rows.append(row), print(json.dumps(row), flush=True))
  base = {"benchmark": "engine_defaults"}
  names = ["tiny"] if args.quick else ["tiny", "3M"]
  slots = 4 if args.quick else 32
  budgets = (16, 64) if args.quick else (64, 256, 1024)
  burst_budget = 64 if args.quick else 128
  longest = max(_engine_cfg(slots, max(budgets), "blocks").length,
                _engine_cfg(slots, burst_budget).length)
  begin = time.perf_counter()
  for name in names:
    model = sampler_bench._model(name, longest)  # noqa: SLF001
    for n in budgets if "kv_cache" in parts else ():
      dense = measure(name, model, _engine_cfg(slots, n, "dense"), 2 * slots)
      emit({**base, "part": "kv_cache", **dense, **vs(dense, dense, "vs_dense")})
      for attention in ("blocks", "widths"):
        paged = measure(name, model, _engine_cfg(slots, n, attention), 2 * slots)
        emit({**base, "part": "kv_cache", **paged, **vs(paged, dense, "vs_dense")})
    if "burst" in parts:
      one = measure(name, model, _engine_cfg(slots, burst_budget, burst=1), 2 * slots)
      emit({**base, "part": "burst", **one, **vs(one, one, "vs_burst_1")})
      four = measure(name, model, _engine_cfg(slots, burst_budget, burst=4), 2 * slots)
      emit({**base, "part": "burst", **four, **vs(four, one, "vs_burst_1")})
      emit({**base, "part": "round_trip", **round_trip(one, four)})
  if "long_slots" in parts:
    long_slots(args.quick, emit)
  if "cache" in parts:
    name = "tiny" if args.quick else "3M"
    budgets = (64,) if args.quick else tuple(int(b) for b in args.cache_budgets.split(","))
    with tempfile.TemporaryDirectory(prefix="engine_cache_") as scratch:
      for n in budgets:
        for attention in engine_harness.ATTENTION:
          folder = os.path.join(scratch, f"{attention}_{n}")
          cold = start_in_child(name, attention, slots, n, folder)
          emit({**base, "part": "cache", "start": "cold", **cold})
          warm = start_in_child(name, attention, slots, n, folder)
          emit({**base, "part": "cache", "start": "warm", **warm,
                "vs_cold": round(warm["startup_s"] / cold["startup_s"], 2)})
  print(f"\ntotal {time.perf_counter() - begin:.1f} s\n")
  for part in dict.fromkeys(r["part"] for r in rows):
    report.print_table([r for r in rows if r["part"] == part], title=part,
                       skip=("benchmark", "part", "tokens", "decode_s", "prefill_s"))
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
