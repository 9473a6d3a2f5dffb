"""The process itself in a plan, where a device's memory is the host's (a CPU backend).

On an accelerator `dry_run.plan` counts device memory: Python, the runtime
and the compiled programs live in host memory beside it. On a CPU backend
they share the one memory a run is measured against (`benchmarks/memory.py`),
and at a small model's size they are most of it: `configs/arith.py`'s 0.4M
parameters hold 9 MiB of arrays in a 0.6 GiB process.

Measured on XLA:CPU (jax 0.10.2, 2026-12-07; the resident size after
`malloc_trim`, before and after compiling each of an engine's programs, and
an update program), and rough:

- the interpreter with JAX, XLA and arl_jax imported: 0.24 GiB;
- a program that runs the decoder (decode, insert, a prefill chunk, a KV
  recompute) keeps 16 MiB and 1.1 MiB a layer: 18-24 MiB at arith's 2
  layers, 40-62 at SmolLM2's 30; an update about four times one (its
  forward and backward passes and the optimizer over every leaf: 66 MiB at
  arith's, 222 at SmolLM2's with LoRA, scanned);
- a program that only moves rows (fork, reads, the page table, a chunked
  prefill's start): 4 MiB (1-12 measured).

The programs counted are every shape the sampler precompiles
(`precompile.engine_shapes`), every shape the evaluation's engines may
compile (they compile the ones they meet), and an update per packed width a
batch may take (`packing.candidate_widths`: a run trains on each sooner or
later). Compiling a program takes XLA's and LLVM's working memory while it
lasts: compiling the update peaked 3.2 times what it keeps (SmolLM2's with
LoRA: +0.70 GiB) to 4.7 times (arith's, with a cold compilation cache);
`compile_transient_bytes` plans three times the update's. A compile runs
before its program does, never beside an update's temporaries
(`dry_run.COMPILE`).
"""

from __future__ import annotations

from arl_jax.config import run_spec
from arl_jax.core import packing as packing_lib
from arl_jax.sampler import engine_config, precompile
from arl_jax.training import evaluation

_MIB = 2**20
RUNTIME = 240 * _MIB
DECODER_PROGRAM = 16 * _MIB
DECODER_PROGRAM_PER_LAYER = int(1.1 * _MIB)
MOVER_PROGRAM = 4 * _MIB
UPDATE_PROGRAMS_PER_DECODER_PROGRAM = 4
COMPILE_TRANSIENT_PER_UPDATE_PROGRAM = 3


def engine_programs(cfg: engine_config.EngineConfig) -> tuple[int, int]:
  """`(decoder, mover)` programs an engine of `cfg` can compile."""
  shapes = precompile.engine_shapes(cfg)
  decoder = (len(shapes.decode) + len(shapes.insert) + len(shapes.prefill)
             + len(shapes.widths) * int(shapes.recompute))
  return decoder, shapes.num_programs - decoder


def update_programs(spec: run_spec.RunSpec) -> int:
  """Update programs a run compiles: one per packed width its batches may
  take (padded rows: one per completion length, counted as one)."""
  if spec.packing is None:
    return 1
  longest = spec.engine.prompt_len + spec.engine.max_new_tokens
  return len(packing_lib.candidate_widths(longest, spec.packing.pack_len))


def _decoder_program(spec: run_spec.RunSpec) -> int:
  return DECODER_PROGRAM + DECODER_PROGRAM_PER_LAYER * spec.model.num_layers


def compile_transient_bytes(spec: run_spec.RunSpec) -> int:
  """What compiling the update takes while it lasts (the module docstring)."""
  return COMPILE_TRANSIENT_PER_UPDATE_PROGRAM * UPDATE_PROGRAMS_PER_DECODER_PROGRAM * (
      _decoder_program(spec))


def cpu_process_bytes(spec: run_spec.RunSpec) -> int:
  """The process besides its arrays on a CPU backend (the module docstring)."""
  engines = [spec.engine]
  if spec.run.eval_every and spec.run.eval_size:
    engines.append(evaluation.greedy_engine_config(spec.engine, spec.run.eval_size,
                                                   spec.run.eval_slots))
    if spec.run.eval_samples:
      engines.append(evaluation.sampled_engine_config(spec.engine, spec.run.eval_size,
                                                      spec.run.eval_samples))
  decoder_program = _decoder_program(spec)
  total = RUNTIME
  for cfg in engines:
    decoder, mover = engine_programs(cfg)
    total += decoder * decoder_program + mover * MOVER_PROGRAM
  updates = update_programs(spec)
  return total + updates * UPDATE_PROGRAMS_PER_DECODER_PROGRAM * decoder_program
